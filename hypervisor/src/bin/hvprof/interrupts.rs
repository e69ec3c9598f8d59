//! The IDT, the exception entry stubs, and what happens on a fault.
//!
//! Stable Rust has no `x86-interrupt` ABI, so every vector enters through a small assembly stub
//! that pushes a dummy error code where the CPU pushes none (SDM Vol. 3A §7.13, "Error Code"),
//! then the vector number, then every general-purpose register, and calls [`dispatch`] with a
//! pointer to the resulting [`TrapFrame`]. The stubs and the frame are `hvprof_x86_trap`'s
//! (`shared/x86-trap`), the same the test guests use.
//!
//! A #GP or #UD whose RIP is listed in the `.fixup` section (see [`super::msr`]) resumes at the
//! listed continuation with the vector reported in R8: that is how RDMSR/WRMSR probe MSRs that
//! may not exist. Every other exception prints a register dump and powers the machine off.

use crate::arch::gdt;
use crate::console::emergency_writer;
use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};
use spin::Once;
use x86_64::VirtAddr;
use x86_64::registers::control::{Cr0, Cr2, Cr3, Cr4};
use x86_64::structures::idt::InterruptDescriptorTable;

/// The register state the entry stubs save (`shared/x86-trap`).
pub use hvprof_x86_trap::TrapFrame;

// The 256 entry stubs, shared with the test guests: each calls `dispatch` with the frame.
hvprof_x86_trap::trap_stubs!(dispatch);

static IDT: Once<InterruptDescriptorTable> = Once::new();

/// Builds the IDT (shared by every CPU; IST stacks are per-CPU through each TSS) and loads it.
/// Call after the GDT is loaded, since entries take the current CS.
pub fn init() {
    let idt = IDT.call_once(|| {
        let mut idt = InterruptDescriptorTable::new();
        let stub = |v: u8| VirtAddr::new(hvprof_x86_trap::stub_address(v));
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
            for (entry, vector) in idt.slice_mut(32..).iter_mut().zip(32..=u8::MAX) {
                entry.set_handler_addr(stub(vector));
            }
        }
        idt
    });
    idt.load();
}

/// "#GP general protection" (SDM Vol. 3A Table 7-1), or "interrupt".
struct Name(u64);

impl core::fmt::Display for Name {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match hvprof_x86_trap::describe(self.0) {
            Some((mnemonic, name)) => write!(f, "{mnemonic} {name}"),
            None => f.write_str("interrupt"),
        }
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
    // A fixup answers a #GP or #UD of its instruction, never an interrupt that arrived just
    // before it (the saved RIP is the same): taking the timer's interrupt for a #GP of a WRMSR
    // would skip the WRMSR and the interrupt's EOI, and the pCPU would never hear its timer again.
    if hvprof_x86_trap::resolve_fixup(frame) {
        return;
    }
    if frame.vector == 2 {
        // NMI: the PMU's overflow (a sample), or something else, counted and reported at the end
        // of the run (an NMI may interrupt the console's holder: it never prints).
        if !crate::profiler::pmu::on_nmi_host(frame.rip, frame.rbp) {
            STRAY.note(2, frame.rip);
        }
        return;
    }
    if frame.vector == crate::arch::host_apic::TIMER_VECTOR as u64 {
        crate::profiler::on_timer(frame.rip, frame.rbp);
        return;
    }
    if frame.vector == crate::arch::host_apic::KICK_VECTOR as u64 {
        crate::profiler::sampler::on_kick();
        return;
    }
    if frame.vector == crate::arch::host_apic::SPURIOUS_VECTOR as u64 {
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
        Name(frame.vector),
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
