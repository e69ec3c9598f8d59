//! `probe`: checks the guest ABI's CPUID, MSR, I/O, hypercall and entry-state policy from
//! inside the guest.
//!
//! No arguments. Each check prints `probe: ok <name>` or
//! `probe: FAIL <name>: got <X> expected <Y>`; the last line is
//! `probe: <n> passed, <m> failed`, and the exit code is 0 when all passed, 1 otherwise.
//! Besides the serial output, the `hypercall.print` check prints one line through PRINT.
#![no_std]
#![no_main]

use core::fmt::{self, Display};
use hvprof_guests::cpu::{self, Fault, cpuid, rdmsr_safe, wrmsr_safe};
use hvprof_guests::{hypercall, io, println, serial};

hvprof_guests::guest_entry!(main);

const IA32_TSC: u32 = 0x10;
const IA32_APIC_BASE: u32 = 0x1b;
const IA32_MCG_CAP: u32 = 0x179;
const IA32_TSC_AUX: u32 = 0xc000_0103;
const IA32_FEATURE_CONTROL: u32 = 0x3a;
const IA32_VMX_BASIC: u32 = 0x480;
const IA32_VMX_VMFUNC: u32 = 0x491;
const UNKNOWN_MSR: u32 = 0x1234_5678;
const IA32_EFER: u32 = 0xc000_0080;
const IA32_LSTAR: u32 = 0xc000_0082;
const IA32_KERNEL_GS_BASE: u32 = 0xc000_0102;

const UNUSED_PORT: u16 = 0x2e8;

/// What an MSR access or hypercall produced, for printing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Value(u64),
    Fault(Fault),
}

impl Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Value(v) => write!(f, "{v:#x}"),
            Outcome::Fault(fault) => write!(f, "{fault}"),
        }
    }
}

impl From<Result<u64, Fault>> for Outcome {
    fn from(r: Result<u64, Fault>) -> Self {
        match r {
            Ok(v) => Outcome::Value(v),
            Err(f) => Outcome::Fault(f),
        }
    }
}

impl From<Result<(), Fault>> for Outcome {
    fn from(r: Result<(), Fault>) -> Self {
        match r {
            // A write that went through: shown as "no fault".
            Ok(()) => Outcome::Value(0),
            Err(f) => Outcome::Fault(f),
        }
    }
}

/// Prints a value as hex.
struct Hex(u64);

impl Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[derive(Default)]
struct Probe {
    passed: u32,
    failed: u32,
}

impl Probe {
    fn check(&mut self, name: &str, ok: bool, got: impl Display, expected: impl Display) {
        if ok {
            self.passed += 1;
            println!("probe: ok {name}");
        } else {
            self.failed += 1;
            println!("probe: FAIL {name}: got {got} expected {expected}");
        }
    }

    fn eq<T: PartialEq + Display>(&mut self, name: &str, got: T, expected: T) {
        let ok = got == expected;
        self.check(name, ok, got, expected);
    }

    fn hex(&mut self, name: &str, got: u64, expected: u64) {
        self.check(name, got == expected, Hex(got), Hex(expected));
    }

    fn msr_reads(&mut self, name: &str, msr: u32, expected: u64) {
        self.eq(name, rdmsr_safe(msr).into(), Outcome::Value(expected));
    }

    fn msr_read_faults(&mut self, name: &str, msr: u32) {
        self.eq(name, rdmsr_safe(msr).into(), Outcome::Fault(Fault::GP));
    }

    /// Writes `value`, reads it back, restores the old value.
    ///
    /// # Safety
    /// `msr` must be one whose temporary value does not matter to this guest.
    unsafe fn msr_round_trip(&mut self, name: &str, msr: u32, value: u64) {
        let old = match rdmsr_safe(msr) {
            Ok(v) => v,
            Err(f) => return self.check(name, false, f, Hex(value)),
        };
        // SAFETY: the caller vouches that the value does not matter; it is restored below.
        if let Err(f) = unsafe { wrmsr_safe(msr, value) } {
            return self.check(name, false, format_args!("{f} on write"), Hex(value));
        }
        let back = rdmsr_safe(msr);
        // SAFETY: puts back what was there.
        let _ = unsafe { wrmsr_safe(msr, old) };
        self.eq(name, back.into(), Outcome::Value(value));
    }
}

fn bit(value: u32, n: u32) -> u32 {
    (value >> n) & 1
}

fn main(_args: &str) -> u8 {
    let mut p = Probe::default();

    // CPUID.
    let leaf1 = cpuid(1, 0);
    p.eq("cpuid.1.ecx.vmx", bit(leaf1.ecx, 5), 0);
    p.eq("cpuid.1.ecx.hypervisor", bit(leaf1.ecx, 31), 1);
    let base = cpuid(0x4000_0000, 0);
    p.check(
        "cpuid.40000000.eax",
        base.eax >= 0x4000_0001,
        Hex(base.eax.into()),
        ">= 0x40000001",
    );
    let mut sig = [0u8; 12];
    sig[0..4].copy_from_slice(&base.ebx.to_le_bytes());
    sig[4..8].copy_from_slice(&base.ecx.to_le_bytes());
    sig[8..12].copy_from_slice(&base.edx.to_le_bytes());
    let sig = core::str::from_utf8(&sig).unwrap_or("<not UTF-8>");
    p.eq("cpuid.40000000.signature", sig, "hvprofhvprof");
    let features = cpuid(0x4000_0001, 0);
    p.hex("cpuid.40000001.eax", features.eax.into(), 1);

    // Hypercalls.
    p.eq("hypercall.version", hypercall::version(), 1);
    p.hex(
        "hypercall.print",
        hypercall::print(b"probe: hypercall print\n"),
        0,
    );
    p.hex(
        "hypercall.print.outside",
        hypercall::hypercall(hypercall::PRINT, 1 << 40, 16),
        hypercall::ERR_BAD_BUFFER,
    );
    p.hex(
        "hypercall.unknown",
        hypercall::hypercall(0x1234, 0, 0),
        hypercall::ERR_UNKNOWN,
    );

    // MSRs.
    p.msr_reads("msr.feature_control.read", IA32_FEATURE_CONTROL, 1);
    // SAFETY: the write must fault; were it to succeed, writing the value just read changes
    // nothing.
    let write = unsafe { wrmsr_safe(IA32_FEATURE_CONTROL, 1) };
    p.eq(
        "msr.feature_control.write",
        write.into(),
        Outcome::Fault(Fault::GP),
    );
    p.msr_read_faults("msr.vmx_basic.read", IA32_VMX_BASIC);
    p.msr_read_faults("msr.vmx_vmfunc.read", IA32_VMX_VMFUNC);
    p.msr_read_faults("msr.unknown.read", UNKNOWN_MSR);
    p.msr_reads("msr.apic_base.read", IA32_APIC_BASE, 0xfee0_0900);
    let efer = rdmsr_safe(IA32_EFER);
    let want = (1 << 8) | (1 << 10) | (1 << 11); // LME, LMA, NXE
    p.check(
        "msr.efer.read",
        efer.is_ok_and(|e| e & want == want),
        Outcome::from(efer),
        "LME|LMA|NXE (0xd00) set",
    );
    let tsc = rdmsr_safe(IA32_TSC);
    p.check("msr.tsc.read", tsc.is_ok(), Outcome::from(tsc), "no fault");
    // The vCPU's own counter: a write moves what RDTSC gives, not the host's TSC (the
    // profile's time axis stays the host's). Far ahead, so that the reading after it is at
    // most a few thousand ticks past.
    const AHEAD: u64 = 1 << 56;
    // SAFETY: nothing in this guest times anything with the TSC after this.
    let write = unsafe { wrmsr_safe(IA32_TSC, AHEAD) };
    let now = cpu::rdtsc();
    p.check(
        "msr.tsc.write",
        write.is_ok() && (AHEAD..AHEAD + 1_000_000).contains(&now),
        Hex(now),
        "RDTSC just past 1 << 56",
    );
    p.msr_reads("msr.mcg_cap.read", IA32_MCG_CAP, 0);
    // RDTSCP gives the vCPU's own IA32_TSC_AUX (where CPUID offers it).
    if bit(cpuid(0x8000_0001, 0).edx, 27) == 1 {
        // SAFETY: this guest does not use TSC_AUX (no RDPID, no per-CPU lookups).
        let write = unsafe { wrmsr_safe(IA32_TSC_AUX, 0x1234) };
        let aux: u32;
        // SAFETY: RDTSCP reads the TSC and TSC_AUX into EDX:EAX and ECX, nothing else.
        unsafe {
            core::arch::asm!("rdtscp", out("eax") _, out("edx") _, out("ecx") aux, options(nomem, nostack));
        }
        p.check(
            "rdtscp.tsc_aux",
            write.is_ok() && aux == 0x1234,
            Hex(aux.into()),
            "0x1234 as written",
        );
    }
    // CPUID.1:ECX.OSXSAVE is this vCPU's CR4.OSXSAVE.
    p.eq(
        "cpuid.1.ecx.osxsave",
        bit(leaf1.ecx, 27),
        u32::from(cpu::read_cr4() & (1 << 18) != 0),
    );
    // SAFETY: this guest never executes SYSCALL nor SWAPGS; both are restored.
    unsafe {
        p.msr_round_trip("msr.lstar.roundtrip", IA32_LSTAR, 0xffff_8000_dead_b000);
        p.msr_round_trip(
            "msr.kernel_gs_base.roundtrip",
            IA32_KERNEL_GS_BASE,
            0xffff_8000_cafe_f000,
        );
    }

    // I/O ports.
    // SAFETY: nothing is behind port 0x2e8.
    let unused = unsafe { io::inb(UNUSED_PORT) };
    p.hex("io.unused.read", unused.into(), 0xff);
    // SAFETY: reading the virtual UART's LSR has no side effect.
    let lsr = unsafe { io::inb(serial::LSR) };
    p.hex("io.uart.lsr", lsr.into(), 0x60);
    for value in [0xa5u8, 0x5a] {
        // SAFETY: the scratch register stores a byte and does nothing else.
        let back = unsafe {
            io::outb(serial::SCR, value);
            io::inb(serial::SCR)
        };
        p.hex("io.uart.scratch", back.into(), value.into());
    }
    // String I/O through the scratch register: REP OUTSB up and down (the last byte sent
    // stays), REP INSB; RSI, RDI and RCX move as the SDM says.
    let out = [0x11u8, 0x22, 0x33];
    let mut back = [0u8; 3];
    let (rsi, rcx): (u64, u64);
    // SAFETY: OUTSB reads the 3 bytes of `out`; the scratch register only stores a byte.
    unsafe {
        core::arch::asm!("cld", "rep outsb", inout("rsi") out.as_ptr() as u64 => rsi,
            inout("rcx") 3u64 => rcx, in("dx") serial::SCR, options(nostack, readonly));
    }
    // SAFETY: reading the scratch register has no side effect.
    let last = unsafe { io::inb(serial::SCR) };
    p.check(
        "io.string.outsb.up",
        last == 0x33 && rsi == out.as_ptr() as u64 + 3 && rcx == 0,
        Hex(last.into()),
        "0x33, RSI past the bytes, RCX 0",
    );
    let rsi: u64;
    // SAFETY: as above, from the last byte down to the first; DF is cleared again.
    unsafe {
        core::arch::asm!("std", "rep outsb", "cld", inout("rsi") out.as_ptr() as u64 + 2 => rsi,
            inout("rcx") 3u64 => _, in("dx") serial::SCR, options(nostack, readonly));
    }
    // SAFETY: reading the scratch register has no side effect.
    let last = unsafe { io::inb(serial::SCR) };
    p.check(
        "io.string.outsb.down",
        last == 0x11 && rsi == out.as_ptr() as u64 - 1,
        Hex(last.into()),
        "0x11, RSI below the bytes",
    );
    let rdi: u64;
    // SAFETY: INSB writes the 3 bytes of `back`.
    unsafe {
        core::arch::asm!("cld", "rep insb", inout("rdi") back.as_mut_ptr() as u64 => rdi,
            inout("rcx") 3u64 => _, in("dx") serial::SCR, options(nostack));
    }
    p.check(
        "io.string.insb",
        back == [0x11; 3] && rdi == back.as_ptr() as u64 + 3,
        Hex(u64::from(back[0]) | u64::from(back[1]) << 8 | u64::from(back[2]) << 16),
        "0x111111, RDI past the bytes",
    );
    // A REP longer than the hypervisor moves in one exit (4,096) resumes where it stopped.
    static mut LONG: [u8; 10_000] = [0; 10_000];
    let at = (&raw mut LONG) as u64;
    let (rdi, rcx): (u64, u64);
    // SAFETY: the scratch register stores a byte; INSB writes the 10,000 bytes of `LONG`,
    // which nothing else uses.
    unsafe {
        io::outb(serial::SCR, 0x5e);
        core::arch::asm!("cld", "rep insb", inout("rdi") at => rdi,
            inout("rcx") 10_000u64 => rcx, in("dx") serial::SCR, options(nostack));
    }
    // SAFETY: `LONG`'s 10,000 bytes, read after the writes above; nothing else touches them.
    let long = unsafe { core::slice::from_raw_parts(at as *const u8, 10_000) };
    let all = long.iter().all(|&b| b == 0x5e);
    p.check(
        "io.string.insb.long",
        all && rdi == at + 10_000 && rcx == 0,
        Hex(rdi - at),
        "10,000 bytes of 0x5e, RDI past them, RCX 0",
    );

    // Entry state as the guest sees it.
    let cr0 = cpu::read_cr0();
    let want = 1 | (1 << 4) | (1 << 5) | (1 << 16) | (1 << 31); // PE, ET, NE, WP, PG
    p.check(
        "cr0",
        cr0 & want == want,
        Hex(cr0),
        "PE|ET|NE|WP|PG (0x80010031) set",
    );
    let cr4 = cpu::read_cr4();
    p.check(
        "cr4.vmxe.hidden",
        cr4 & (1 << 13) == 0,
        Hex(cr4),
        "VMXE (bit 13) clear",
    );

    println!("probe: {} passed, {} failed", p.passed, p.failed);
    u8::from(p.failed != 0)
}
