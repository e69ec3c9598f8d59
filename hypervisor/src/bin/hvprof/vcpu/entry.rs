//! The VM entry/exit stub: one call runs the guest until its next VM exit.
//!
//! `vmx_run(regs, launched)` saves the host's callee-saved registers, writes the current RSP to
//! the VMCS host-RSP field, loads the guest's general-purpose registers from `regs` and executes
//! VMLAUNCH (first entry) or VMRESUME. On a VM exit the CPU loads host RSP and RIP from the VMCS
//! (SDM Vol. 3C §28.5.1), so execution continues at `vmx_exit_landing` with the stack exactly as
//! the stub left it: the guest registers are stored back into `regs`, the host registers popped,
//! and the call returns 0. If VMLAUNCH/VMRESUME itself fails (VMfailInvalid/VMfailValid, SDM
//! Vol. 3C §32.2), execution falls through and the call returns the RFLAGS that say which.
//!
//! The layout of `regs` is `hvprof_vmx::regs::GuestRegisters`, whose offsets are passed in as
//! constants, so the asm and the struct cannot drift apart.

use hvprof_vmx::regs::GuestRegisters as R;
use hvprof_vmx::vmcs::HostNatural;

/// Runs the guest of the current VMCS. Returns 0 after a VM exit, or the RFLAGS of a failed
/// VMLAUNCH/VMRESUME (CF = VMfailInvalid, ZF = VMfailValid).
///
/// # Safety
/// This CPU is in VMX root operation with a current VMCS whose host state is this hypervisor's
/// (host RIP = `vmx_exit_landing`, host CR3/GDT/IDT/TR valid) and whose guest state is valid;
/// `launched` tells whether that VMCS was launched since its last VMCLEAR.
#[unsafe(naked)]
pub unsafe extern "C" fn vmx_run(regs: *mut R, launched: u64) -> u64 {
    core::arch::naked_asm!(
        // Host callee-saved registers (System V ABI), then the `regs` pointer on top.
        "push rbp",
        "push rbx",
        "push r12",
        "push r13",
        "push r14",
        "push r15",
        "push rdi",
        // HOST_RSP = the current RSP: the exit lands with this stack (SDM Vol. 3C §28.5.1).
        "mov rax, {host_rsp}",
        "vmwrite rax, rsp",
        // Guest registers; RDI last, as it holds the pointer.
        "mov rax, [rdi + {cr2}]",
        "mov cr2, rax",
        "mov rax, [rdi + {rax}]",
        "mov rbx, [rdi + {rbx}]",
        "mov rcx, [rdi + {rcx}]",
        "mov rdx, [rdi + {rdx}]",
        "mov rbp, [rdi + {rbp}]",
        "mov r8, [rdi + {r8}]",
        "mov r9, [rdi + {r9}]",
        "mov r10, [rdi + {r10}]",
        "mov r11, [rdi + {r11}]",
        "mov r12, [rdi + {r12}]",
        "mov r13, [rdi + {r13}]",
        "mov r14, [rdi + {r14}]",
        "mov r15, [rdi + {r15}]",
        "test rsi, rsi",
        "mov rsi, [rdi + {rsi}]",
        "mov rdi, [rdi + {rdi}]",
        "jnz 2f",
        "vmlaunch",
        "jmp 3f",
        "2:",
        "vmresume",
        "3:",
        // VM entry failed: the guest registers are in the host's registers; the stack is as
        // pushed. Return RFLAGS (non-zero: bit 1 is always set).
        "pushfq",
        "pop rax",
        "add rsp, 8",
        "pop r15",
        "pop r14",
        "pop r13",
        "pop r12",
        "pop rbx",
        "pop rbp",
        "ret",

        ".global vmx_exit_landing",
        "vmx_exit_landing:",
        // RSP = HOST_RSP: [rsp] = regs pointer. Save the guest's RDI first to free a register.
        "push rdi",
        "mov rdi, [rsp + 8]",
        "mov [rdi + {rax}], rax",
        "mov [rdi + {rbx}], rbx",
        "mov [rdi + {rcx}], rcx",
        "mov [rdi + {rdx}], rdx",
        "mov [rdi + {rsi}], rsi",
        "mov [rdi + {rbp}], rbp",
        "mov [rdi + {r8}], r8",
        "mov [rdi + {r9}], r9",
        "mov [rdi + {r10}], r10",
        "mov [rdi + {r11}], r11",
        "mov [rdi + {r12}], r12",
        "mov [rdi + {r13}], r13",
        "mov [rdi + {r14}], r14",
        "mov [rdi + {r15}], r15",
        "mov rax, cr2",
        "mov [rdi + {cr2}], rax",
        "pop rax",
        "mov [rdi + {rdi}], rax",
        "add rsp, 8",
        "pop r15",
        "pop r14",
        "pop r13",
        "pop r12",
        "pop rbx",
        "pop rbp",
        "xor eax, eax",
        "ret",
        host_rsp = const HostNatural::Rsp as u32,
        rax = const R::RAX,
        rbx = const R::RBX,
        rcx = const R::RCX,
        rdx = const R::RDX,
        rsi = const R::RSI,
        rdi = const R::RDI,
        rbp = const R::RBP,
        r8 = const R::R8,
        r9 = const R::R9,
        r10 = const R::R10,
        r11 = const R::R11,
        r12 = const R::R12,
        r13 = const R::R13,
        r14 = const R::R14,
        r15 = const R::R15,
        cr2 = const R::CR2,
    );
}

unsafe extern "C" {
    /// Where a VM exit continues (the VMCS host-RIP field).
    pub fn vmx_exit_landing();
}
