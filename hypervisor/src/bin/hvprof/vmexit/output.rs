//! The output leaf, CPUID 0x40000002 (docs/GUEST-ABI.md, "Output"), for a VM with `output=`:
//! its programs hand the hypervisor their stdout and stderr whole, a buffer per CPUID, instead
//! of a trapped `OUT` per byte to the UART at the console's line rate. CPUID exits at every
//! privilege level (SDM Vol. 3C §26.1.2), so a process needs no I/O permission for it. The
//! bytes are kept in the VM's `OutputStore` and sent after the run as output frames
//! (`vm/report.rs`).
//!
//! - ECX = 0: EAX = the bytes the store can still take (at most `u32::MAX`), EBX = 1 when the
//!   VM has a store (0 and 0 without one).
//! - ECX = 1 (stdout) or 2 (stderr), RSI = the bytes' linear address under the guest's current
//!   page tables, RDI = their count (at most `OUTPUT_MAX`): the store keeps what fits and EAX
//!   returns how many it kept. At CPL 3 only user addresses (below 2^47) are read. Bytes not
//!   kept (no room, or not mapped) are counted as lost; another ECX or a larger count keeps
//!   nothing and returns 0.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::Vm;
use hvprof_samplelog::OutputStream;
use hvprof_vmx::instructions::CurrentVmcs;

/// The CPUID leaf (in the hypervisor's range, after the signature and the ABI version).
pub use hvprof_hypervisor::cpuid_policy::OUTPUT_LEAF;

/// Most bytes one CPUID hands over.
pub const OUTPUT_MAX: u64 = 64 * 1024;

/// The first address above the lower canonical half: user space's end on x86-64.
const USER_END: u64 = 1 << 47;

/// The output leaf's (EAX, EBX, ECX, EDX) for `subleaf`.
pub fn cpuid(vm: &Vm, vcpu: &Vcpu, vmcs: &CurrentVmcs, subleaf: u32) -> (u32, u32, u32, u32) {
    let Some(store) = &vm.output else {
        return (0, 0, 0, 0);
    };
    if subleaf == 0 {
        let free = store.lock().free().min(u32::MAX as usize) as u32;
        return (free, 1, 0, 0);
    }
    let (at, count) = (vcpu.regs.rsi, vcpu.regs.rdi);
    let stream = match u8::try_from(subleaf).ok().and_then(OutputStream::from_u8) {
        Some(s @ (OutputStream::Stdout | OutputStream::Stderr)) if count <= OUTPUT_MAX => s,
        _ => return (0, 0, 0, 0),
    };
    let user = vmcs.guest_cpl() == 3;
    let mut kept = 0u64;
    let mut done = 0u64;
    let mut buf = [0u8; 4096];
    while done < count {
        let la = at.wrapping_add(done);
        let want = (count - done).min(buf.len() as u64) as usize;
        let outside = la >= USER_END || la.saturating_add(want as u64) > USER_END;
        let readable = if user && outside {
            0
        } else {
            super::guest_memory::read_linear(vm, vmcs, la, &mut buf[..want])
        };
        let taken = store.lock().push(stream, &buf[..readable]);
        kept += taken as u64;
        done += readable as u64;
        if readable < want || taken < readable {
            break;
        }
    }
    // What was asked for and not read (not mapped, or after the store filled).
    store.lock().lose(count - done);
    (kept as u32, 0, 0, 0)
}
