//! CPU instructions: CPUID, MSR access that survives #GP/#UD, control registers, `invlpg`, `hlt`.
//!
//! [`rdmsr_safe`] and [`wrmsr_safe`] are `hvprof_x86_trap`'s accessors (`shared/x86-trap`, the
//! same the hypervisor uses): they record their instruction in the `.fixup` section (a pair:
//! faulting RIP, continuation RIP), and when that instruction raises #GP or #UD the exception
//! handler resumes at the continuation and the accessor returns the fault.

pub use crate::fault::Fault;

/// The four registers CPUID returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpuid {
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// Executes exactly one CPUID (a VM exit under VMX) for `leaf`/`subleaf`, in the caller's own
/// code (always inlined: the `stacks` guest's exit causes name the function that executes it).
#[inline(always)]
pub fn cpuid(leaf: u32, subleaf: u32) -> Cpuid {
    let (eax, ebx, ecx, edx): (u32, u64, u32, u32);
    // SAFETY: CPUID only writes the four registers; RBX is reserved by LLVM, so it is saved in a
    // scratch register and swapped back.
    unsafe {
        core::arch::asm!(
            "mov {b}, rbx",
            "cpuid",
            "xchg {b}, rbx",
            b = out(reg) ebx,
            inout("eax") leaf => eax,
            inout("ecx") subleaf => ecx,
            out("edx") edx,
            options(nomem, nostack, preserves_flags),
        );
    }
    Cpuid {
        eax,
        ebx: ebx as u32,
        ecx,
        edx,
    }
}

/// Reads an MSR; `Err` with the vector when RDMSR faulted.
pub fn rdmsr_safe(msr: u32) -> Result<u64, Fault> {
    hvprof_x86_trap::read_msr(msr)
}

/// Writes an MSR; `Err` with the vector when WRMSR faulted.
///
/// # Safety
/// A successful write changes processor behaviour: the caller must know what it does.
pub unsafe fn wrmsr_safe(msr: u32, value: u64) -> Result<(), Fault> {
    // SAFETY: the caller vouches for the effect of the write.
    unsafe { hvprof_x86_trap::write_msr(msr, value) }
}

/// RDPMC of counter `ecx` (bit 30: the fixed counters); `Err` with the vector when it faulted
/// (#GP: no such counter, no PMU, or CR4.PCE clear outside ring 0). Caught as `rdmsr_safe`'s
/// faults are, through a `.fixup` entry.
pub fn rdpmc_safe(ecx: u32) -> Result<u64, Fault> {
    let (lo, hi, marker): (u32, u32, u64);
    // SAFETY: RDPMC writes only EDX:EAX; a #GP is caught through the fixup entry and reported in
    // R8 (the runtime's exception dispatcher calls `hvprof_x86_trap::resolve_fixup`).
    unsafe {
        core::arch::asm!(
            "xor r8d, r8d",
            "2: rdpmc",
            "3:",
            ".pushsection .fixup, \"a\"",
            ".balign 8",
            ".quad 2b, 3b",
            ".popsection",
            in("ecx") ecx,
            out("eax") lo,
            out("edx") hi,
            out("r8") marker,
            options(nostack),
        );
    }
    hvprof_x86_trap::fault_from_marker(marker).map(|()| (u64::from(hi) << 32) | u64::from(lo))
}

/// CR0.
pub fn read_cr0() -> u64 {
    let v: u64;
    // SAFETY: reading CR0 has no side effect at CPL 0.
    unsafe {
        core::arch::asm!("mov {}, cr0", out(reg) v, options(nomem, nostack, preserves_flags))
    };
    v
}

/// CR2, the last page-fault address.
pub fn read_cr2() -> u64 {
    let v: u64;
    // SAFETY: reading CR2 has no side effect at CPL 0.
    unsafe {
        core::arch::asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags))
    };
    v
}

/// CR3, the page-table root.
pub fn read_cr3() -> u64 {
    let v: u64;
    // SAFETY: reading CR3 has no side effect at CPL 0.
    unsafe {
        core::arch::asm!("mov {}, cr3", out(reg) v, options(nomem, nostack, preserves_flags))
    };
    v
}

/// CR4 (as the guest sees it: the hypervisor hides VMXE).
pub fn read_cr4() -> u64 {
    let v: u64;
    // SAFETY: reading CR4 has no side effect at CPL 0.
    unsafe {
        core::arch::asm!("mov {}, cr4", out(reg) v, options(nomem, nostack, preserves_flags))
    };
    v
}

/// Invalidates the TLB entries for the page holding `va`.
///
/// # Safety
/// Only flushes; unsafe because it is meant for code that changed page tables and must make sure
/// the change is complete first.
pub unsafe fn invlpg(va: u64) {
    // SAFETY: INVLPG only drops cached translations.
    unsafe { core::arch::asm!("invlpg [{}]", in(reg) va, options(nostack, preserves_flags)) };
}

/// Executes one HLT (a VM exit under hvprof; with interrupts off, the vCPU resumes only when
/// the hypervisor lets it).
pub fn hlt() {
    // SAFETY: HLT waits; it touches no memory.
    unsafe { core::arch::asm!("hlt", options(nomem, nostack, preserves_flags)) };
}

/// The guest's physical-address width (CPUID.80000008H:EAX[7:0]), 36 when the leaf is missing
/// (SDM Vol. 3A §5.1.4).
pub fn max_phys_addr_bits() -> u32 {
    if cpuid(0x8000_0000, 0).eax >= 0x8000_0008 {
        cpuid(0x8000_0008, 0).eax & 0xff
    } else {
        36
    }
}

/// The time-stamp counter. In Bochs with `clock: sync=none` it counts instructions, so a delta
/// around an exiting instruction is the hypervisor's path length for that exit.
pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC has no side effects; the hypervisor does not set CR4.TSD for guests.
    unsafe { core::arch::x86_64::_rdtsc() }
}
