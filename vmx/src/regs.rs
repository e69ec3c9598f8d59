//! The guest general-purpose registers the VM-entry/exit stub saves and restores.
//!
//! VM entry and VM exit switch RSP, RIP, RFLAGS and the control/segment state through the VMCS
//! (SDM Vol. 3C §27.3.2, §28.3, §28.5), but not the other general-purpose registers, nor CR2: the
//! stub (a naked function in the hypervisor) must load them from a [`GuestRegisters`] before
//! VMLAUNCH/VMRESUME and store them into it right after the VM exit, before any Rust code runs.
//! The stub addresses the fields through the `GuestRegisters::*` offset constants below, e.g.
//! `mov [rdi + {rax}], rax` with `rax = const GuestRegisters::RAX`; the `const` assertions in this
//! file keep them equal to the real layout.

use core::mem::{offset_of, size_of};

/// The layout of the register save area, shared with the assembly stub: 16 little-endian u64s,
/// 128 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestRegisters {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    /// Guest CR2: not part of the VMCS. The stub need only switch it if the host can take a page
    /// fault (or otherwise change CR2) between a VM exit and the next VM entry.
    pub cr2: u64,
}

impl GuestRegisters {
    pub const RAX: usize = 0x00;
    pub const RBX: usize = 0x08;
    pub const RCX: usize = 0x10;
    pub const RDX: usize = 0x18;
    pub const RSI: usize = 0x20;
    pub const RDI: usize = 0x28;
    pub const RBP: usize = 0x30;
    pub const R8: usize = 0x38;
    pub const R9: usize = 0x40;
    pub const R10: usize = 0x48;
    pub const R11: usize = 0x50;
    pub const R12: usize = 0x58;
    pub const R13: usize = 0x60;
    pub const R14: usize = 0x68;
    pub const R15: usize = 0x70;
    pub const CR2: usize = 0x78;
    /// Size in bytes.
    pub const SIZE: usize = 0x80;

    /// The value of a register as numbered in exit qualifications and instruction information.
    /// `None` for RSP, which is the VMCS field `GuestNatural::Rsp`.
    pub fn get(&self, r: Gpr) -> Option<u64> {
        self.slot(r).copied()
    }

    /// Mutable access to a register by number; `None` for RSP (see [`GuestRegisters::get`]).
    pub fn get_mut(&mut self, r: Gpr) -> Option<&mut u64> {
        Some(match r {
            Gpr::Rax => &mut self.rax,
            Gpr::Rcx => &mut self.rcx,
            Gpr::Rdx => &mut self.rdx,
            Gpr::Rbx => &mut self.rbx,
            Gpr::Rsp => return None,
            Gpr::Rbp => &mut self.rbp,
            Gpr::Rsi => &mut self.rsi,
            Gpr::Rdi => &mut self.rdi,
            Gpr::R8 => &mut self.r8,
            Gpr::R9 => &mut self.r9,
            Gpr::R10 => &mut self.r10,
            Gpr::R11 => &mut self.r11,
            Gpr::R12 => &mut self.r12,
            Gpr::R13 => &mut self.r13,
            Gpr::R14 => &mut self.r14,
            Gpr::R15 => &mut self.r15,
        })
    }

    fn slot(&self, r: Gpr) -> Option<&u64> {
        Some(match r {
            Gpr::Rax => &self.rax,
            Gpr::Rcx => &self.rcx,
            Gpr::Rdx => &self.rdx,
            Gpr::Rbx => &self.rbx,
            Gpr::Rsp => return None,
            Gpr::Rbp => &self.rbp,
            Gpr::Rsi => &self.rsi,
            Gpr::Rdi => &self.rdi,
            Gpr::R8 => &self.r8,
            Gpr::R9 => &self.r9,
            Gpr::R10 => &self.r10,
            Gpr::R11 => &self.r11,
            Gpr::R12 => &self.r12,
            Gpr::R13 => &self.r13,
            Gpr::R14 => &self.r14,
            Gpr::R15 => &self.r15,
        })
    }
}

const _: () = {
    assert!(offset_of!(GuestRegisters, rax) == GuestRegisters::RAX);
    assert!(offset_of!(GuestRegisters, rbx) == GuestRegisters::RBX);
    assert!(offset_of!(GuestRegisters, rcx) == GuestRegisters::RCX);
    assert!(offset_of!(GuestRegisters, rdx) == GuestRegisters::RDX);
    assert!(offset_of!(GuestRegisters, rsi) == GuestRegisters::RSI);
    assert!(offset_of!(GuestRegisters, rdi) == GuestRegisters::RDI);
    assert!(offset_of!(GuestRegisters, rbp) == GuestRegisters::RBP);
    assert!(offset_of!(GuestRegisters, r8) == GuestRegisters::R8);
    assert!(offset_of!(GuestRegisters, r9) == GuestRegisters::R9);
    assert!(offset_of!(GuestRegisters, r10) == GuestRegisters::R10);
    assert!(offset_of!(GuestRegisters, r11) == GuestRegisters::R11);
    assert!(offset_of!(GuestRegisters, r12) == GuestRegisters::R12);
    assert!(offset_of!(GuestRegisters, r13) == GuestRegisters::R13);
    assert!(offset_of!(GuestRegisters, r14) == GuestRegisters::R14);
    assert!(offset_of!(GuestRegisters, r15) == GuestRegisters::R15);
    assert!(offset_of!(GuestRegisters, cr2) == GuestRegisters::CR2);
    assert!(size_of::<GuestRegisters>() == GuestRegisters::SIZE);
};

/// A general-purpose register in the numbering of VM-exit qualifications and instruction
/// information (SDM Vol. 3C Table 28-3 bits 11:8; §28.2.5): 0 RAX, 1 RCX, 2 RDX, 3 RBX, 4 RSP,
/// 5 RBP, 6 RSI, 7 RDI, 8-15 R8-R15.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gpr {
    Rax = 0,
    Rcx = 1,
    Rdx = 2,
    Rbx = 3,
    Rsp = 4,
    Rbp = 5,
    Rsi = 6,
    Rdi = 7,
    R8 = 8,
    R9 = 9,
    R10 = 10,
    R11 = 11,
    R12 = 12,
    R13 = 13,
    R14 = 14,
    R15 = 15,
}

impl Gpr {
    /// Decodes the low 4 bits of `n`.
    pub const fn from_number(n: u8) -> Self {
        match n & 0xf {
            0 => Gpr::Rax,
            1 => Gpr::Rcx,
            2 => Gpr::Rdx,
            3 => Gpr::Rbx,
            4 => Gpr::Rsp,
            5 => Gpr::Rbp,
            6 => Gpr::Rsi,
            7 => Gpr::Rdi,
            8 => Gpr::R8,
            9 => Gpr::R9,
            10 => Gpr::R10,
            11 => Gpr::R11,
            12 => Gpr::R12,
            13 => Gpr::R13,
            14 => Gpr::R14,
            _ => Gpr::R15,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_by_number() {
        let mut r = GuestRegisters::default();
        for n in 0..16u8 {
            let g = Gpr::from_number(n);
            assert_eq!(g as u8, n);
            if g == Gpr::Rsp {
                assert!(r.get_mut(g).is_none() && r.get(g).is_none());
            } else {
                *r.get_mut(g).unwrap() = 0x100 + u64::from(n);
            }
        }
        assert_eq!((r.rax, r.rcx, r.rdx, r.rbx), (0x100, 0x101, 0x102, 0x103));
        assert_eq!(
            (r.rbp, r.rsi, r.rdi, r.r8, r.r15),
            (0x105, 0x106, 0x107, 0x108, 0x10f)
        );
        assert_eq!(r.get(Gpr::R12), Some(0x10c));
        assert_eq!(r.cr2, 0);
    }
}
