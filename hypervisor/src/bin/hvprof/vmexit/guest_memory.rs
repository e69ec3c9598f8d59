//! Reading a guest's memory at a linear address, as an exit handler needs it (the instruction
//! an APIC access faulted on, the bytes the output leaf is handed).

use crate::vcpu::guest_ops::must;
use crate::vm::Vm;
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{GuestNatural, VmcsExt};
use x86_64::registers::control::Cr0Flags;

/// Copies the guest's memory at linear address `la` into `out` through its own page tables
/// (with paging on: `guest_walk::translate_leaf`, SDM Vol. 3A §5.5), as far as it is mapped;
/// the number of bytes copied.
pub fn read_linear(vm: &Vm, vmcs: &CurrentVmcs, la: u64, out: &mut [u8]) -> usize {
    let ram = vm.ram();
    let paging =
        must(vmcs.read_natural(GuestNatural::Cr0), "VMREAD CR0") & Cr0Flags::PAGING.bits() != 0;
    let cr3 = must(vmcs.read_natural(GuestNatural::Cr3), "VMREAD CR3");
    let mut done = 0;
    while done < out.len() {
        let at = la.wrapping_add(done as u64);
        let gpa = if paging {
            match hvprof_hypervisor::profiler::guest_walk::translate_leaf(
                &|gpa| ram.read_u64(gpa),
                cr3,
                at,
            ) {
                Some(leaf) => leaf.gpa,
                None => break,
            }
        } else {
            at
        };
        // Up to the end of this 4 KiB page.
        let n = (out.len() - done).min(0x1000 - (at & 0xfff) as usize);
        if !ram.read(gpa, &mut out[done..done + n]) {
            break;
        }
        done += n;
    }
    done
}
