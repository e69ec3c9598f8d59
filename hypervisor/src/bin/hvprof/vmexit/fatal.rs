//! Stopping a VM for what its guest did: the report names what happened, where, and the guest's
//! registers.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::Stop;
use alloc::string::String;
use core::fmt::Write;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{GuestNatural, VmcsExt};

/// Stops the VM with a report: what happened, where, and the guest's registers.
pub fn fatal(vcpu: &Vcpu, vmcs: &CurrentVmcs, what: String) -> Stop {
    let rd = |f| vmcs.read_natural(f).unwrap_or(0);
    let r = &vcpu.regs;
    let mut s = what;
    let _ = write!(
        s,
        "\nguest RIP={:#018x} RSP={:#018x} RFLAGS={:#x} CR0={:#x} CR3={:#x} CR4={:#x} CPL={}",
        rd(GuestNatural::Rip),
        rd(GuestNatural::Rsp),
        rd(GuestNatural::Rflags),
        rd(GuestNatural::Cr0),
        rd(GuestNatural::Cr3),
        rd(GuestNatural::Cr4),
        vmcs.guest_cpl()
    );
    let _ = write!(
        s,
        "\nRAX={:#018x} RBX={:#018x} RCX={:#018x} RDX={:#018x}\nRSI={:#018x} RDI={:#018x} RBP={:#018x} R8 ={:#018x}\nR9 ={:#018x} R10={:#018x} R11={:#018x} R12={:#018x}\nR13={:#018x} R14={:#018x} R15={:#018x}",
        r.rax,
        r.rbx,
        r.rcx,
        r.rdx,
        r.rsi,
        r.rdi,
        r.rbp,
        r.r8,
        r.r9,
        r.r10,
        r.r11,
        r.r12,
        r.r13,
        r.r14,
        r.r15
    );
    Stop::Fault(s)
}
