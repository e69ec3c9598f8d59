//! The guest's own IDT: the hypervisor starts the guest with none (IDTR limit 0).
//!
//! All 256 vectors enter through 16-byte assembly stubs that push a dummy error code where the CPU
//! pushes none (SDM Vol. 3A §7.13), the vector, and the general-purpose registers, then call
//! [`dispatch`] with the resulting [`TrapFrame`]. A #GP or #UD raised by an instruction listed in
//! `.fixup` resumes at its continuation with `0x100 | vector` in R8 (see `cpu::rdmsr_safe`);
//! anything else prints `guest: unexpected exception <vector> at RIP=<hex>` and exits with
//! [`crate::exit_code::UNEXPECTED_EXCEPTION`].

use crate::fault;
use core::mem::{offset_of, size_of};

/// The registers saved by the stubs, lowest address first.
#[repr(C)]
struct TrapFrame {
    r15: u64,
    r14: u64,
    r13: u64,
    r12: u64,
    r11: u64,
    r10: u64,
    r9: u64,
    r8: u64,
    rbp: u64,
    rdi: u64,
    rsi: u64,
    rdx: u64,
    rcx: u64,
    rbx: u64,
    rax: u64,
    vector: u64,
    error_code: u64,
    // Pushed by the CPU (SDM Vol. 3A §7.14.4).
    rip: u64,
    cs: u64,
    rflags: u64,
    rsp: u64,
    ss: u64,
}

// Keep the stub's 15 pushes and the struct in step; 22 quadwords keep RSP 16-byte aligned at the
// `call` (the CPU aligns RSP before pushing its frame in 64-bit mode).
const _: () = assert!(size_of::<TrapFrame>() == 22 * 8);
const _: () = assert!(offset_of!(TrapFrame, vector) == 15 * 8);
const _: () = assert!(offset_of!(TrapFrame, rip) == 17 * 8);

const STUB_SIZE: u64 = 16;

core::arch::global_asm!(
    r#"
    .section .text.hvprof_guest_trap_stubs, "ax"
    .balign 16
    .global hvprof_guest_trap_stubs
hvprof_guest_trap_stubs:
    .set vec, 0
    .rept 256
    .balign 16
    .if (vec == 8) || (vec == 10) || (vec == 11) || (vec == 12) || (vec == 13) || (vec == 14) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    push 0
    .endif
    push vec
    jmp .Lhvprof_guest_trap_common
    .set vec, vec + 1
    .endr

.Lhvprof_guest_trap_common:
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
    static hvprof_guest_trap_stubs: [u8; 256 * STUB_SIZE as usize];
    static __fixup_start: [FixupEntry; 0];
    static __fixup_end: [FixupEntry; 0];
}

/// One `.fixup` entry.
#[repr(C)]
struct FixupEntry {
    fault_rip: u64,
    continue_rip: u64,
}

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
    let stubs = (&raw const hvprof_guest_trap_stubs) as u64;
    let idt = &raw mut IDT;
    for vector in 0..256 {
        let handler = stubs + vector as u64 * STUB_SIZE;
        let gate = Gate {
            offset_low: handler as u16,
            selector: cs,
            ist: 0,
            attributes: INTERRUPT_GATE,
            offset_mid: (handler >> 16) as u16,
            offset_high: (handler >> 32) as u32,
            reserved: 0,
        };
        // SAFETY: `vector` < 256 is inside the table; nothing else uses the IDT before `lidt`.
        unsafe { (*idt)[vector] = gate };
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

fn fixups() -> &'static [FixupEntry] {
    // SAFETY: the linker script brackets the `.fixup` output section, 8-byte aligned, with these
    // symbols; every input is a pair of quadwords (cpu.rs), immutable after link time.
    unsafe {
        let start = (&raw const __fixup_start).cast::<FixupEntry>();
        let end = (&raw const __fixup_end).cast::<FixupEntry>();
        core::slice::from_raw_parts(start, end.offset_from(start) as usize)
    }
}

extern "C" fn dispatch(frame: &mut TrapFrame) {
    let v = frame.vector;
    if (v == fault::GP as u64 || v == fault::UD as u64)
        && let Some(fix) = fixups().iter().find(|f| f.fault_rip == frame.rip)
    {
        frame.r8 = 0x100 | v;
        frame.rip = fix.continue_rip;
        return;
    }
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
