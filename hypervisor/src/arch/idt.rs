//! The IDT, the exception entry stubs, and what happens on a fault.
//!
//! Stable Rust has no `x86-interrupt` ABI, so every vector enters through a small assembly stub
//! that pushes a dummy error code where the CPU pushes none (SDM Vol. 3A §7.13, "Error Code"),
//! then the vector number, then every general-purpose register, and calls [`dispatch`] with a
//! pointer to the resulting [`TrapFrame`]. The layout of that frame is checked at compile time.
//!
//! A fault whose RIP is listed in the `.fixup` section (see [`super::msr`]) resumes at the
//! listed continuation with the vector reported in R8: that is how RDMSR/WRMSR probe MSRs that
//! may not exist. Every other exception prints a register dump and powers the machine off.

use super::gdt;
use crate::console::emergency_writer;
use core::fmt::Write;
use core::mem::{offset_of, size_of};
use core::sync::atomic::{AtomicU64, Ordering};
use spin::Once;
use x86_64::VirtAddr;
use x86_64::registers::control::{Cr0, Cr2, Cr3, Cr4};
use x86_64::structures::idt::InterruptDescriptorTable;

/// The register state saved by the entry stubs, lowest address first.
#[repr(C)]
#[derive(Debug)]
pub struct TrapFrame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rbp: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rbx: u64,
    pub rax: u64,
    pub vector: u64,
    pub error_code: u64,
    // Pushed by the CPU (SDM Vol. 3A §7.14.4, Figure 7-9).
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

// The stub pushes 15 registers after vector and error code: keep the asm and the struct in step.
const _: () = assert!(size_of::<TrapFrame>() == 22 * 8);
const _: () = assert!(offset_of!(TrapFrame, rax) == 14 * 8);
const _: () = assert!(offset_of!(TrapFrame, vector) == 15 * 8);
const _: () = assert!(offset_of!(TrapFrame, rip) == 17 * 8);
// 22 quadwords keep RSP 16-byte aligned at the `call` (the CPU aligns before pushing its frame).
const _: () = assert!(size_of::<TrapFrame>().is_multiple_of(16));

/// Stub length: every stub is padded to this many bytes so stub N is at `trap_stubs + 16 * N`.
const STUB_SIZE: usize = 16;

// 256 stubs, then the common part. The vectors with an error code (SDM Vol. 3A Table 7-1) skip
// the dummy push. `.rept` with an assembler counter keeps the vector numbers
// out of Rust; each stub is `[push 0] ; push vector ; jmp trap_common`, padded to 16 bytes.
core::arch::global_asm!(
    r#"
    .section .text.trap_stubs, "ax"
    .balign 16
    .global trap_stubs
trap_stubs:
    .set vec, 0
    .rept 256
    .balign 16
    .if (vec == 8) || (vec == 10) || (vec == 11) || (vec == 12) || (vec == 13) || (vec == 14) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    push 0
    .endif
    push vec
    jmp trap_common
    .set vec, vec + 1
    .endr

trap_common:
    push rax
    push rbx
    push rcx
    push rdx
    push rsi
    push rdi
    push rbp
    push r8
    push r9
    push r10
    push r11
    push r12
    push r13
    push r14
    push r15
    mov rdi, rsp
    cld
    call {dispatch}
    pop r15
    pop r14
    pop r13
    pop r12
    pop r11
    pop r10
    pop r9
    pop r8
    pop rbp
    pop rdi
    pop rsi
    pop rdx
    pop rcx
    pop rbx
    pop rax
    add rsp, 16
    iretq
"#,
    dispatch = sym dispatch,
);

unsafe extern "C" {
    static trap_stubs: [u8; 256 * STUB_SIZE];
    static __fixup_start: [FixupEntry; 0];
    static __fixup_end: [FixupEntry; 0];
}

/// One `.fixup` entry: a faulting instruction and where to continue.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FixupEntry {
    pub fault_rip: u64,
    pub continue_rip: u64,
}

static IDT: Once<InterruptDescriptorTable> = Once::new();

/// Builds the IDT (shared by every CPU; IST stacks are per-CPU through each TSS) and loads it.
/// Call after the GDT is loaded, since entries take the current CS.
pub fn init() {
    let idt = IDT.call_once(|| {
        let mut idt = InterruptDescriptorTable::new();
        let base = VirtAddr::from_ptr(core::ptr::addr_of!(trap_stubs));
        let stub = |v: u64| base + v * STUB_SIZE as u64;
        // SAFETY: (all `set_handler_addr` calls) stub N is an entry stub written above for
        // vector N, with the right error-code handling for that vector; the IST indices name
        // stacks that every CPU's TSS provides (see `gdt`).
        unsafe {
            idt.divide_error.set_handler_addr(stub(0));
            idt.debug.set_handler_addr(stub(1));
            idt.non_maskable_interrupt
                .set_handler_addr(stub(2))
                .set_stack_index(gdt::IST_NMI);
            idt.breakpoint.set_handler_addr(stub(3));
            idt.overflow.set_handler_addr(stub(4));
            idt.bound_range_exceeded.set_handler_addr(stub(5));
            idt.invalid_opcode.set_handler_addr(stub(6));
            idt.device_not_available.set_handler_addr(stub(7));
            idt.double_fault
                .set_handler_addr(stub(8))
                .set_stack_index(gdt::IST_DOUBLE_FAULT);
            idt.invalid_tss.set_handler_addr(stub(10));
            idt.segment_not_present.set_handler_addr(stub(11));
            idt.stack_segment_fault.set_handler_addr(stub(12));
            idt.general_protection_fault.set_handler_addr(stub(13));
            idt.page_fault.set_handler_addr(stub(14));
            idt.x87_floating_point.set_handler_addr(stub(16));
            idt.alignment_check.set_handler_addr(stub(17));
            idt.machine_check
                .set_handler_addr(stub(18))
                .set_stack_index(gdt::IST_MACHINE_CHECK);
            idt.simd_floating_point.set_handler_addr(stub(19));
            idt.virtualization.set_handler_addr(stub(20));
            idt.cp_protection_exception.set_handler_addr(stub(21));
            idt.hv_injection_exception.set_handler_addr(stub(28));
            idt.vmm_communication_exception.set_handler_addr(stub(29));
            idt.security_exception.set_handler_addr(stub(30));
            for (i, entry) in idt.slice_mut(32..).iter_mut().enumerate() {
                entry.set_handler_addr(stub(32 + i as u64));
            }
        }
        idt
    });
    idt.load();
}

fn fixups() -> &'static [FixupEntry] {
    // SAFETY: the linker script brackets the `.fixup` output section with these two symbols;
    // every input is a pair of quadwords emitted by `msr.rs`, so the span is a whole number of
    // `FixupEntry` values, 8-byte aligned, immutable after link time.
    unsafe {
        let start = core::ptr::addr_of!(__fixup_start) as *const FixupEntry;
        let end = core::ptr::addr_of!(__fixup_end) as *const FixupEntry;
        core::slice::from_raw_parts(start, end.offset_from(start) as usize)
    }
}

pub const fn name(vector: u64) -> &'static str {
    match vector {
        0 => "#DE divide error",
        1 => "#DB debug",
        2 => "NMI",
        3 => "#BP breakpoint",
        4 => "#OF overflow",
        5 => "#BR bound range",
        6 => "#UD invalid opcode",
        7 => "#NM device not available",
        8 => "#DF double fault",
        10 => "#TS invalid TSS",
        11 => "#NP segment not present",
        12 => "#SS stack fault",
        13 => "#GP general protection",
        14 => "#PF page fault",
        16 => "#MF x87 error",
        17 => "#AC alignment check",
        18 => "#MC machine check",
        19 => "#XM SIMD error",
        20 => "#VE virtualization",
        21 => "#CP control protection",
        _ => "interrupt",
    }
}

/// NMIs and interrupts nobody expected: how many, and the last one.
pub struct Stray {
    nmis: AtomicU64,
    interrupts: AtomicU64,
    /// Vector and RIP of the last one, packed: vector in bits 63:56.
    last: AtomicU64,
}

impl Stray {
    fn note(&self, vector: u64, rip: u64) {
        if vector == 2 {
            &self.nmis
        } else {
            &self.interrupts
        }
        .fetch_add(1, Ordering::Relaxed);
        self.last
            .store((vector << 56) | (rip & ((1 << 56) - 1)), Ordering::Relaxed);
    }

    /// Prints what arrived, if anything (at the end of the run, outside any handler).
    pub fn report(&self) {
        let (nmis, ints) = (
            self.nmis.load(Ordering::Relaxed),
            self.interrupts.load(Ordering::Relaxed),
        );
        if nmis + ints > 0 {
            let last = self.last.load(Ordering::Relaxed);
            crate::println!(
                "hvprof: warning: {nmis} NMIs not from the profiler's counter and {ints} unexpected interrupts; the last: vector {} at RIP={:#x}",
                last >> 56,
                last & ((1 << 56) - 1)
            );
        }
    }
}

pub static STRAY: Stray = Stray {
    nmis: AtomicU64::new(0),
    interrupts: AtomicU64::new(0),
    last: AtomicU64::new(0),
};

extern "C" fn dispatch(frame: &mut TrapFrame) {
    // A fixup answers an exception of its instruction, never an interrupt that arrived just
    // before it (the saved RIP is the same): taking the timer's interrupt for a #GP of a WRMSR
    // would skip the WRMSR and the interrupt's EOI, and the pCPU would never hear its timer again.
    if let Some(fix) = fixups()
        .iter()
        .find(|f| frame.vector < 32 && frame.vector != 2 && f.fault_rip == frame.rip)
    {
        frame.r8 = frame.vector + 1;
        frame.rip = fix.continue_rip;
        return;
    }
    if frame.vector == 2 {
        // NMI: the PMU's overflow (a sample), or something else, counted and reported at the end
        // of the run (an NMI may interrupt the console's holder: it never prints).
        if !crate::profiler::pmu::on_nmi_host(frame.rip) {
            STRAY.note(2, frame.rip);
        }
        return;
    }
    if frame.vector == super::lapic::TIMER_VECTOR as u64 {
        crate::profiler::on_timer(frame.rip);
        return;
    }
    if frame.vector == super::lapic::SPURIOUS_VECTOR as u64 {
        // A spurious interrupt needs no EOI (SDM Vol. 3A §12.9).
        return;
    }
    if frame.vector >= 32 {
        // The hypervisor enables no other interrupt source; one arriving anyway is counted,
        // reported at the end of the run, and ignored, not fatal. Printing here could interrupt
        // the console's holder and tear a frame.
        STRAY.note(frame.vector, frame.rip);
        return;
    }
    fatal(frame)
}

fn fatal(frame: &TrapFrame) -> ! {
    let mut w = emergency_writer();
    let _ = writeln!(
        w,
        "EXCEPTION: {} (vector {}, error code {:#x}) at RIP={:#018x}",
        name(frame.vector),
        frame.vector,
        frame.error_code,
        frame.rip
    );
    let _ = dump(&mut w, frame);
    crate::power::off_after_fault()
}

/// Prints the register dump of a trap frame.
pub fn dump(w: &mut impl Write, f: &TrapFrame) -> core::fmt::Result {
    writeln!(
        w,
        "  RIP={:#018x} CS={:#06x} RFLAGS={:#018x} RSP={:#018x} SS={:#06x}",
        f.rip, f.cs, f.rflags, f.rsp, f.ss
    )?;
    writeln!(
        w,
        "  RAX={:#018x} RBX={:#018x} RCX={:#018x} RDX={:#018x}",
        f.rax, f.rbx, f.rcx, f.rdx
    )?;
    writeln!(
        w,
        "  RSI={:#018x} RDI={:#018x} RBP={:#018x} R8 ={:#018x}",
        f.rsi, f.rdi, f.rbp, f.r8
    )?;
    writeln!(
        w,
        "  R9 ={:#018x} R10={:#018x} R11={:#018x} R12={:#018x}",
        f.r9, f.r10, f.r11, f.r12
    )?;
    writeln!(
        w,
        "  R13={:#018x} R14={:#018x} R15={:#018x}",
        f.r13, f.r14, f.r15
    )?;
    let (cr3, _) = Cr3::read_raw();
    writeln!(
        w,
        "  CR0={:#018x} CR2={:#018x} CR3={:#018x} CR4={:#018x}",
        Cr0::read_raw(),
        Cr2::read_raw(),
        cr3.start_address().as_u64(),
        Cr4::read_raw()
    )
}
