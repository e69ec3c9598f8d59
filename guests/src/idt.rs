//! The guest's own IDT: the hypervisor starts the guest with none (IDTR limit 0).
//!
//! All 256 vectors enter through 16-byte assembly stubs that push a dummy error code where the CPU
//! pushes none (SDM Vol. 3A §7.13), the vector, and the general-purpose registers, then call
//! [`dispatch`] with the resulting [`TrapFrame`]; stubs, frame and fixups are `hvprof_x86_trap`'s
//! (`shared/x86-trap`), the same the hypervisor uses. A #GP or #UD raised by an instruction
//! listed in `.fixup` resumes at its continuation (see `cpu::rdmsr_safe`); anything else prints
//! `guest: unexpected exception <vector> at RIP=<hex>` and exits with
//! [`crate::exit_code::UNEXPECTED_EXCEPTION`].

use crate::fault;
use core::mem::size_of;
use hvprof_x86_trap::TrapFrame;

// The 256 entry stubs, shared with the hypervisor: each calls `dispatch` with the frame.
hvprof_x86_trap::trap_stubs!(dispatch);

/// A 64-bit interrupt gate (SDM Vol. 3A §7.14.1, Figure 7-8).
#[repr(C)]
#[derive(Clone, Copy)]
struct Gate {
    offset_low: u16,
    selector: u16,
    ist: u8,
    attributes: u8,
    offset_mid: u16,
    offset_high: u32,
    reserved: u32,
}

const _: () = assert!(size_of::<Gate>() == 16);

const MISSING: Gate = Gate {
    offset_low: 0,
    selector: 0,
    ist: 0,
    attributes: 0,
    offset_mid: 0,
    offset_high: 0,
    reserved: 0,
};

/// Present, DPL 0, 64-bit interrupt gate (IF cleared on entry: it is clear anyway).
const INTERRUPT_GATE: u8 = 0x8e;

static mut IDT: [Gate; 256] = [MISSING; 256];

#[repr(C, packed)]
struct Idtr {
    limit: u16,
    base: u64,
}

/// Fills and loads the IDT. Called once, first thing, by the runtime.
pub(crate) fn init() {
    let cs: u16;
    // SAFETY: reading CS has no side effect.
    unsafe {
        core::arch::asm!("mov {:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags))
    };
    let idt = &raw mut IDT;
    for vector in 0..=u8::MAX {
        let handler = hvprof_x86_trap::stub_address(vector);
        let gate = Gate {
            offset_low: handler as u16,
            selector: cs,
            ist: 0,
            attributes: INTERRUPT_GATE,
            offset_mid: (handler >> 16) as u16,
            offset_high: (handler >> 32) as u32,
            reserved: 0,
        };
        // SAFETY: a `u8` vector is inside the 256-entry table; nothing else uses the IDT before
        // `lidt`.
        unsafe { (*idt)[usize::from(vector)] = gate };
    }
    let idtr = Idtr {
        limit: (size_of::<[Gate; 256]>() - 1) as u16,
        base: idt as u64,
    };
    // SAFETY: the IDT is static and complete; every gate points at a stub above, in the code
    // segment the guest runs in.
    unsafe {
        core::arch::asm!("lidt [{}]", in(reg) &idtr, options(readonly, nostack, preserves_flags))
    };
}

/// Handlers of interrupt vectors (32-255) a guest installed with [`on_interrupt`]: a `fn(u8)`
/// as a `usize`, 0 for none.
static HANDLERS: [core::sync::atomic::AtomicUsize; 256] =
    [const { core::sync::atomic::AtomicUsize::new(0) }; 256];

/// Calls `handler(vector)` when interrupt `vector` (32-255) arrives, instead of treating it as
/// unexpected; the handler runs with interrupts off and returns to the interrupted code.
pub fn on_interrupt(vector: u8, handler: fn(u8)) {
    if vector >= 32 {
        HANDLERS[usize::from(vector)]
            .store(handler as usize, core::sync::atomic::Ordering::Release);
    }
}

extern "C" fn dispatch(frame: &mut TrapFrame) {
    if let Some(h) = HANDLERS.get(frame.vector as usize) {
        let h = h.load(core::sync::atomic::Ordering::Acquire);
        if h != 0 {
            // SAFETY: only `on_interrupt` stores here, and it stores a `fn(u8)`.
            let handler: fn(u8) = unsafe { core::mem::transmute::<usize, fn(u8)>(h) };
            handler(frame.vector as u8);
            return;
        }
    }
    if hvprof_x86_trap::resolve_fixup(frame) {
        return;
    }
    let v = frame.vector;
    crate::println!("guest: unexpected exception {} at RIP={:#x}", v, frame.rip);
    let cr2 = if v == fault::PF as u64 {
        crate::cpu::read_cr2()
    } else {
        0
    };
    crate::println!(
        "guest:   {} error code {:#x} CR2={:#x} RSP={:#x} RFLAGS={:#x} RAX={:#x} RDI={:#x}",
        fault::mnemonic(v).unwrap_or("interrupt"),
        frame.error_code,
        cr2,
        frame.rsp,
        frame.rflags,
        frame.rax,
        frame.rdi,
    );
    crate::rt::exit(crate::exit_code::UNEXPECTED_EXCEPTION)
}
