//! x86-64 exception entry and fault-tolerant MSR access, shared by the hypervisor
//! (`hypervisor/src/bin/hvprof/arch/`) and the test guests (`guests/`), which both run at CPL 0
//! in 64-bit mode without the `x86-interrupt` ABI (stable Rust has none).
//!
//! - [`trap_stubs!`] emits 256 entry stubs, one per vector, [`STUB_SIZE`] bytes apart from the
//!   symbol `hvprof_trap_stubs`. Each pushes a dummy error code where the CPU pushes none (SDM
//!   Vol. 3A §7.13, "Error Code"; [`has_error_code`]), then the vector number, then every
//!   general-purpose register, and calls the user's dispatcher with the resulting [`TrapFrame`];
//!   when it returns, the registers (as the dispatcher left them) are restored and IRETQ resumes
//!   at the frame's RIP. What a vector means is the user's business: the hypervisor samples and
//!   reports, a guest prints and exits.
//! - [`read_msr`] and [`write_msr`] record their RDMSR/WRMSR in the `.fixup` section (a pair:
//!   faulting RIP, continuation RIP). When that instruction raises #GP or #UD — the only
//!   exceptions RDMSR and WRMSR raise in 64-bit mode (SDM Vol. 2, RDMSR and WRMSR, "64-Bit Mode
//!   Exceptions") — the dispatcher calls [`resolve_fixup`], which resumes at the continuation
//!   with `0x100 | vector` in R8 (zero before the access), and the accessor returns
//!   `Err(Fault)`. The linker script must gather `.fixup` between `__fixup_start` and
//!   `__fixup_end`, 8-byte aligned, and keep it.
//!
//! The pure parts ([`TrapFrame`]'s layout, [`Fault`], [`has_error_code`], [`fixup_continuation`])
//! build and are tested on the host; the parts touching the machine are
//! `#[cfg(target_os = "none")]`.
#![cfg_attr(not(test), no_std)]

use core::fmt;
use core::mem::{offset_of, size_of};

/// The register state saved by the entry stubs, lowest address first.
#[repr(C)]
#[derive(Debug, Default, Clone, PartialEq, Eq)]
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
const _: () = assert!(offset_of!(TrapFrame, r8) == 7 * 8);
const _: () = assert!(offset_of!(TrapFrame, rax) == 14 * 8);
const _: () = assert!(offset_of!(TrapFrame, vector) == 15 * 8);
const _: () = assert!(offset_of!(TrapFrame, rip) == 17 * 8);
// 22 quadwords keep RSP 16-byte aligned at the `call` (the CPU aligns RSP before pushing its
// frame in 64-bit mode, SDM Vol. 3A §7.14.2).
const _: () = assert!(size_of::<TrapFrame>().is_multiple_of(16));

/// Stub length: every stub is padded to this many bytes, so stub N is at
/// `hvprof_trap_stubs + STUB_SIZE * N`.
pub const STUB_SIZE: u64 = 16;

/// Whether the CPU pushes an error code for an exception with this vector (SDM Vol. 3A Table 7-1:
/// #DF, #TS, #NP, #SS, #GP, #PF, #AC, #CP, #VC, #SX). The stubs of [`trap_stubs!`] skip the dummy
/// push for exactly these vectors.
pub const fn has_error_code(vector: u8) -> bool {
    matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30)
}

/// Emits the 256 entry stubs (symbol `hvprof_trap_stubs`, section `.text.hvprof_trap_stubs`) and
/// their common part, which calls `$dispatch`, an `extern "C" fn(&mut TrapFrame)`. Use it once per
/// binary; point IDT gate N at [`stub_address`]`(N)`.
///
/// The `.if` list is [`has_error_code`]'s.
#[macro_export]
macro_rules! trap_stubs {
    ($dispatch:path) => {
        const _: extern "C" fn(&mut $crate::TrapFrame) = $dispatch;
        ::core::arch::global_asm!(
            r#"
    .section .text.hvprof_trap_stubs, "ax"
    .balign 16
    .global hvprof_trap_stubs
hvprof_trap_stubs:
    .set vec, 0
    .rept 256
    .balign 16
    .if (vec == 8) || (vec == 10) || (vec == 11) || (vec == 12) || (vec == 13) || (vec == 14) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    push 0
    .endif
    push vec
    jmp .Lhvprof_trap_common
    .set vec, vec + 1
    .endr

.Lhvprof_trap_common:
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
            dispatch = sym $dispatch,
        );
    };
}

/// The address of the entry stub for `vector` (the stubs come from [`trap_stubs!`]).
#[cfg(target_os = "none")]
pub fn stub_address(vector: u8) -> u64 {
    unsafe extern "C" {
        static hvprof_trap_stubs: [u8; 256 * STUB_SIZE as usize];
    }
    (&raw const hvprof_trap_stubs) as u64 + u64::from(vector) * STUB_SIZE
}

/// #UD, invalid opcode.
pub const UD: u8 = 6;
/// #GP, general protection.
pub const GP: u8 = 13;
/// #PF, page fault.
pub const PF: u8 = 14;

/// An exception raised by an instruction that was expected to fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub vector: u8,
}

impl Fault {
    pub const GP: Fault = Fault { vector: GP };
    pub const UD: Fault = Fault { vector: UD };
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match mnemonic(u64::from(self.vector)) {
            Some(m) => f.write_str(m),
            None => write!(f, "vector {}", self.vector),
        }
    }
}

/// The mnemonic of an exception vector (SDM Vol. 3A Table 7-1), or `None` for a reserved one or
/// one above 31.
pub const fn mnemonic(vector: u64) -> Option<&'static str> {
    match describe(vector) {
        Some((m, _)) => Some(m),
        None => None,
    }
}

/// The mnemonic and the name of an exception vector (SDM Vol. 3A Table 7-1).
pub const fn describe(vector: u64) -> Option<(&'static str, &'static str)> {
    Some(match vector {
        0 => ("#DE", "divide error"),
        1 => ("#DB", "debug"),
        2 => ("NMI", "non-maskable interrupt"),
        3 => ("#BP", "breakpoint"),
        4 => ("#OF", "overflow"),
        5 => ("#BR", "bound range"),
        6 => ("#UD", "invalid opcode"),
        7 => ("#NM", "device not available"),
        8 => ("#DF", "double fault"),
        10 => ("#TS", "invalid TSS"),
        11 => ("#NP", "segment not present"),
        12 => ("#SS", "stack fault"),
        13 => ("#GP", "general protection"),
        14 => ("#PF", "page fault"),
        16 => ("#MF", "x87 error"),
        17 => ("#AC", "alignment check"),
        18 => ("#MC", "machine check"),
        19 => ("#XM", "SIMD error"),
        20 => ("#VE", "virtualization"),
        21 => ("#CP", "control protection"),
        _ => return None,
    })
}

/// One `.fixup` entry: a faulting instruction and where to continue.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixupEntry {
    pub fault_rip: u64,
    pub continue_rip: u64,
}

/// Where to continue when `vector` was raised at `rip`: the continuation of a listed RDMSR/WRMSR
/// for #GP or #UD, else `None`. Never for another vector: an interrupt (or NMI) that arrives just
/// before a listed instruction has the same saved RIP, and taking it for the instruction's fault
/// would skip the instruction and lose the interrupt.
pub fn fixup_continuation(entries: &[FixupEntry], vector: u64, rip: u64) -> Option<u64> {
    if vector != u64::from(GP) && vector != u64::from(UD) {
        return None;
    }
    entries
        .iter()
        .find(|f| f.fault_rip == rip)
        .map(|f| f.continue_rip)
}

/// The R8 value a resolved fault leaves for the accessor: `0x100 | vector` (never 0).
pub const fn fault_marker(vector: u64) -> u64 {
    0x100 | vector
}

/// Reads the R8 an accessor got back: 0 is success, else the marker of [`fault_marker`].
pub fn fault_from_marker(r8: u64) -> Result<(), Fault> {
    if r8 == 0 {
        Ok(())
    } else {
        Err(Fault {
            vector: (r8 & 0xff) as u8,
        })
    }
}

/// The `.fixup` entries of this binary.
#[cfg(target_os = "none")]
pub fn fixups() -> &'static [FixupEntry] {
    unsafe extern "C" {
        static __fixup_start: [FixupEntry; 0];
        static __fixup_end: [FixupEntry; 0];
    }
    // SAFETY: the linker script brackets the `.fixup` output section, 8-byte aligned, with these
    // two symbols; every input is a pair of quadwords emitted by `read_msr`/`write_msr` below, so
    // the span is a whole number of `FixupEntry` values, immutable after link time.
    unsafe {
        let start = (&raw const __fixup_start).cast::<FixupEntry>();
        let end = (&raw const __fixup_end).cast::<FixupEntry>();
        core::slice::from_raw_parts(start, end.offset_from(start) as usize)
    }
}

/// For the dispatcher, first thing: when the frame is a #GP or #UD of a listed RDMSR/WRMSR, makes
/// it resume at the continuation with the fault marker in R8 and returns `true`.
#[cfg(target_os = "none")]
pub fn resolve_fixup(frame: &mut TrapFrame) -> bool {
    match fixup_continuation(fixups(), frame.vector, frame.rip) {
        Some(next) => {
            frame.r8 = fault_marker(frame.vector);
            frame.rip = next;
            true
        }
        None => false,
    }
}

/// Reads an MSR; `Err` with the vector when RDMSR faulted.
#[cfg(target_os = "none")]
pub fn read_msr(msr: u32) -> Result<u64, Fault> {
    let (lo, hi, marker): (u32, u32, u64);
    // SAFETY: RDMSR writes only EDX:EAX; a #GP/#UD is caught through the fixup entry and
    // reported in R8 (the dispatcher calls `resolve_fixup`). Both users run at CPL 0.
    unsafe {
        core::arch::asm!(
            "xor r8d, r8d",
            "2: rdmsr",
            "3:",
            ".pushsection .fixup, \"a\"",
            ".balign 8",
            ".quad 2b, 3b",
            ".popsection",
            in("ecx") msr,
            out("eax") lo,
            out("edx") hi,
            out("r8") marker,
            options(nostack),
        );
    }
    fault_from_marker(marker).map(|()| (u64::from(hi) << 32) | u64::from(lo))
}

/// Writes an MSR; `Err` with the vector when WRMSR faulted.
///
/// # Safety
/// A successful write changes processor behaviour: the caller must know what it does.
#[cfg(target_os = "none")]
pub unsafe fn write_msr(msr: u32, value: u64) -> Result<(), Fault> {
    let marker: u64;
    // SAFETY: the caller vouches for the effect of the write; a #GP/#UD is caught through the
    // fixup entry and reported in R8.
    unsafe {
        core::arch::asm!(
            "xor r8d, r8d",
            "2: wrmsr",
            "3:",
            ".pushsection .fixup, \"a\"",
            ".balign 8",
            ".quad 2b, 3b",
            ".popsection",
            in("ecx") msr,
            in("eax") (value & 0xffff_ffff) as u32,
            in("edx") (value >> 32) as u32,
            out("r8") marker,
            options(nostack),
        );
    }
    fault_from_marker(marker)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn error_code_vectors_are_table_7_1s() {
        let with: Vec<u8> = (0..=255).filter(|&v| has_error_code(v)).collect();
        assert_eq!(with, [8, 10, 11, 12, 13, 14, 17, 21, 29, 30]);
    }

    #[test]
    fn fault_names() {
        assert_eq!(Fault::GP.to_string(), "#GP");
        assert_eq!(Fault::UD.to_string(), "#UD");
        assert_eq!(Fault { vector: 9 }.to_string(), "vector 9");
        assert_eq!(Fault { vector: 200 }.to_string(), "vector 200");
        assert_eq!(mnemonic(u64::from(PF)), Some("#PF"));
        assert_eq!(describe(13), Some(("#GP", "general protection")));
        assert_eq!(describe(32), None);
    }

    const TABLE: [FixupEntry; 2] = [
        FixupEntry {
            fault_rip: 0x1000,
            continue_rip: 0x1002,
        },
        FixupEntry {
            fault_rip: 0x2000,
            continue_rip: 0x2002,
        },
    ];

    #[test]
    fn only_gp_and_ud_of_a_listed_instruction_continue() {
        assert_eq!(fixup_continuation(&TABLE, 13, 0x2000), Some(0x2002));
        assert_eq!(fixup_continuation(&TABLE, 6, 0x1000), Some(0x1002));
        assert_eq!(fixup_continuation(&TABLE, 13, 0x1001), None);
        // The timer's interrupt or an NMI arriving just before the RDMSR has the same RIP.
        for vector in [2, 32, 0xec, 0xff, 14, 18] {
            assert_eq!(fixup_continuation(&TABLE, vector, 0x1000), None, "{vector}");
        }
        assert_eq!(fixup_continuation(&[], 13, 0x1000), None);
    }

    proptest! {
        /// The marker a resolved fault leaves in R8 is never "no fault" and gives the vector back.
        #[test]
        fn marker_round_trips(vector in any::<u8>()) {
            let marker = fault_marker(u64::from(vector));
            prop_assert_ne!(marker, 0);
            prop_assert_eq!(fault_from_marker(marker), Err(Fault { vector }));
        }
    }

    #[test]
    fn no_fault_is_ok() {
        assert_eq!(fault_from_marker(0), Ok(()));
    }
}
