//! The output port 0xf5 (docs/GUEST-ABI.md, "Output port"), for a VM with `output=`: its
//! programs hand the hypervisor their stdout and stderr whole, a buffer per `OUT`, instead of a
//! trapped `OUT` per byte to the UART at the console's line rate. The bytes are kept in the
//! VM's `OutputStore` and sent after the run as output frames (`vm/report.rs`).
//!
//! - `IN` (any size): the bytes the store can still take (at most `u32::MAX`).
//! - `OUT` of AL = 1 (stdout) or 2 (stderr) with RSI = the bytes' linear address under the
//!   guest's current page tables and RCX = their count (at most `OUTPUT_MAX`): the store keeps
//!   what fits and RCX returns how many it kept. At CPL 3 only user addresses (below 2^47) are
//!   read. Bytes not kept (no room, or not mapped) are counted as lost; a request with another
//!   AL or a larger count takes nothing and returns 0.

use crate::vcpu::Vcpu;
use crate::vcpu::guest_ops::GuestOps;
use crate::vm::Vm;
use hvprof_hypervisor::output_store::OutputStore;
use hvprof_samplelog::OutputStream;
use hvprof_vmx::exit::{IoAccess, IoDirection};
use hvprof_vmx::instructions::CurrentVmcs;
use spin::Mutex;

pub const OUTPUT_PORT: u16 = 0xf5;

/// Most bytes one `OUT` hands over.
pub const OUTPUT_MAX: u64 = 64 * 1024;

/// The first address above the lower canonical half: user space's end on x86-64.
const USER_END: u64 = 1 << 47;

/// Handles an access to the output port of a VM with an output store.
pub fn access(
    vm: &Vm,
    store: &Mutex<OutputStore>,
    vcpu: &mut Vcpu,
    vmcs: &CurrentVmcs,
    io: &IoAccess,
) {
    match io.direction {
        IoDirection::In => {
            let free = store.lock().free().min(u32::MAX as usize) as u64;
            let mask = match io.size {
                1 => 0xff,
                2 => 0xffff,
                _ => 0xffff_ffff,
            };
            super::io::set_in_result(vcpu, io.size, mask, free.min(mask));
        }
        IoDirection::Out => {
            let (stream, at, count) = (vcpu.regs.rax as u8, vcpu.regs.rsi, vcpu.regs.rcx);
            let stream = match OutputStream::from_u8(stream) {
                Some(s @ (OutputStream::Stdout | OutputStream::Stderr)) if count <= OUTPUT_MAX => s,
                _ => {
                    vcpu.regs.rcx = 0;
                    return;
                }
            };
            let user = vmcs.guest_cpl() == 3;
            let mut kept = 0u64;
            let mut done = 0u64;
            let mut buf = [0u8; 4096];
            while done < count {
                let la = at.wrapping_add(done);
                let want = (count - done).min(buf.len() as u64) as usize;
                let readable =
                    if user && (la >= USER_END || la.saturating_add(want as u64) > USER_END) {
                        0
                    } else {
                        super::read_linear(vm, vmcs, la, &mut buf[..want])
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
            vcpu.regs.rcx = kept;
        }
    }
}
