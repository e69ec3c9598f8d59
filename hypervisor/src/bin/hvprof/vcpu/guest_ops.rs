//! The operations on a guest's VMCS that the run loop and every exit handler share, as methods of
//! any VMCS (`GuestOps` on every [`VmcsAccess`]): they wrap `hvprof_vmx::guest` (where they are
//! tested against a fake VMCS) and turn a failed VMREAD/VMWRITE of a field every VMCS has into a
//! panic that names it ([`must`]).

use hvprof_vmx::errors::VmFail;
use hvprof_vmx::vmcs::VmcsAccess;

/// VMREAD/VMWRITE of fields every VMCS has: a failure is a hypervisor bug, reported by a panic
/// that names the access (and powers off), never ignored.
pub fn must<T>(r: Result<T, VmFail>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// What exit handlers do to the guest through its VMCS.
pub trait GuestOps: VmcsAccess + Sized {
    /// Completes an emulated instruction: RIP past it, its STI/MOV-SS shadow ended
    /// (`hvprof_vmx::guest::skip_instruction`, SDM Vol. 3C §28.2.5, §25.4.2).
    fn skip_instruction(&mut self) {
        must(
            hvprof_vmx::guest::skip_instruction(self),
            "skip the emulated instruction",
        );
    }

    /// Injects a hardware exception at the next VM entry (`hvprof_vmx::guest::inject_exception`,
    /// SDM Vol. 3C §27.6).
    fn inject_exception(&mut self, vector: u8, error_code: Option<u32>) {
        must(
            hvprof_vmx::guest::inject_exception(self, vector, error_code),
            "VMWRITE the exception to inject",
        );
    }

    /// The guest's CPL (`hvprof_vmx::guest::cpl`: SS.DPL).
    fn guest_cpl(&self) -> u8 {
        hvprof_vmx::guest::cpl(self).unwrap_or(0)
    }
}

impl<T: VmcsAccess> GuestOps for T {}
