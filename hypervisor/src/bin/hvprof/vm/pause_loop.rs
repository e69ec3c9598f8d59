//! Pause-loop exiting (`ple=on|directed`, SDM Vol. 3C §25.6.13 "Controls for PAUSE-Loop
//! Exiting" and §26.1.3 "Instructions That Cause VM Exits Conditionally", PAUSE): at CPL 0, a
//! PAUSE less than PLE_Gap TSC ticks after the one before it continues a loop, and one more
//! than PLE_Window ticks after the loop's first PAUSE exits. A guest kernel that spins (a
//! spinlock whose holder lost its pCPU, a wait for an IPI the preempted target has not taken)
//! then gives its pCPU up instead of burning the rest of its slice: the scheduler ends the slice
//! as `Yielded` (`scheduler.rs`), with a sample of where it spun.
//!
//! Gap and window are KVM's defaults, which follow the SDM's description of the two fields: the
//! gap an upper bound on the ticks between two PAUSEs of one loop (a spin loop's iteration
//! takes tens), the window an upper bound on the ticks a guest may spin before it yields.
//! PAUSE at CPL 3 never exits this way: a user-mode spin loop is not seen.

use crate::vcpu::guest_ops::must;
use hvprof_vmx::caps::{VmxCaps, proc2};
use hvprof_vmx::instructions::CurrentVmcs;
use hvprof_vmx::vmcs::{Control32, VmcsExt};

/// PLE_Gap, TSC ticks.
pub const GAP: u32 = 128;
/// PLE_Window, TSC ticks.
pub const WINDOW: u32 = 4096;

/// Whether the CPU offers pause-loop exiting.
pub fn offered(caps: &VmxCaps) -> bool {
    caps.procbased2().allows(proc2::PAUSE_LOOP_EXITING)
}

/// Turns pause-loop exiting on in the current VMCS.
pub fn enable(vmcs: &mut CurrentVmcs) {
    let secondary = must(
        vmcs.read32(Control32::SecondaryProcBasedControls),
        "VMREAD secondary controls",
    );
    must(
        vmcs.write32(
            Control32::SecondaryProcBasedControls,
            secondary | proc2::PAUSE_LOOP_EXITING,
        ),
        "VMWRITE secondary controls",
    );
    must(vmcs.write32(Control32::PleGap, GAP), "VMWRITE PLE_Gap");
    must(
        vmcs.write32(Control32::PleWindow, WINDOW),
        "VMWRITE PLE_Window",
    );
}
