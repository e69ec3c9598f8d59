//! Entering VMX root operation on this CPU (Intel SDM Vol. 3C §24.7, "Enabling and Entering VMX
//! Operation", and §24.8, "Restrictions on VMX Operation").

use crate::arch::msr;
use crate::memory;
use hvprof_vmx::caps::{FeatureControl, VmxCaps, msr as vmsr};
use hvprof_vmx::errors::VmFail;
use hvprof_vmx::instructions;
use x86_64::registers::control::{Cr0, Cr0Flags, Cr4, Cr4Flags};

#[derive(Debug)]
pub enum Error {
    FeatureControl,
    Fixed(&'static str),
    NoMemory,
    Vmxon(VmFail),
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::FeatureControl => {
                f.write_str("IA32_FEATURE_CONTROL could not be set to allow VMXON")
            }
            Error::Fixed(what) => write!(f, "{what} cannot satisfy the VMX fixed bits"),
            Error::NoMemory => f.write_str("no memory for the VMXON region"),
            Error::Vmxon(e) => write!(f, "VMXON failed: {e}"),
        }
    }
}

/// Enables VMX on this CPU: IA32_FEATURE_CONTROL, CR0/CR4 fixed bits with CR4.VMXE, the VMXON
/// region, VMXON. Returns the VMXON region's address.
pub fn enable(caps: &VmxCaps) -> Result<u64, Error> {
    // §24.7: VMXON outside SMX needs IA32_FEATURE_CONTROL.LOCK and bit 2. When the firmware left
    // it unlocked we set both (locking it until reset, as every hypervisor does).
    let fc = FeatureControl(
        msr::read_safe(vmsr::IA32_FEATURE_CONTROL).map_err(|_| Error::FeatureControl)?,
    );
    if !fc.locked() {
        let value = fc.0 | FeatureControl::LOCK | FeatureControl::VMX_OUTSIDE_SMX;
        // SAFETY: setting the lock and VMX-outside-SMX bits is the documented way to allow
        // VMXON (§24.7); no other bit changes.
        unsafe { msr::write_safe(vmsr::IA32_FEATURE_CONTROL, value) }
            .map_err(|_| Error::FeatureControl)?;
    } else if !fc.vmx_outside_smx() {
        return Err(Error::FeatureControl);
    }

    // §24.8 and Appendix A.7/A.8: CR0 and CR4 must have every FIXED0 bit set and no bit outside
    // FIXED1 in VMX operation.
    let read = |m| msr::read_safe(m).map_err(|_| Error::Fixed("the fixed-bit MSRs"));
    let (cr0_fixed0, cr0_fixed1) = (
        read(vmsr::IA32_VMX_CR0_FIXED0)?,
        read(vmsr::IA32_VMX_CR0_FIXED1)?,
    );
    let (cr4_fixed0, cr4_fixed1) = (
        read(vmsr::IA32_VMX_CR4_FIXED0)?,
        read(vmsr::IA32_VMX_CR4_FIXED1)?,
    );
    let cr0 = (Cr0::read_raw() | cr0_fixed0) & cr0_fixed1;
    // CR4.OSXSAVE where the CPU has XSAVE: the XSETBV a guest executes is carried out by the
    // hypervisor (SDM Vol. 2D, XSETBV: #UD without it).
    let xsave = if raw_cpuid::CpuId::new()
        .get_feature_info()
        .is_some_and(|f| f.has_xsave())
    {
        Cr4Flags::OSXSAVE.bits()
    } else {
        0
    };
    // The hypervisor itself never uses the FPU/SSE (the target is soft-float), but it saves and
    // restores guest FPU state with FXSAVE/FXRSTOR, which needs CR4.OSFXSR.
    let cr4 = (Cr4::read_raw()
        | cr4_fixed0
        | Cr4Flags::VIRTUAL_MACHINE_EXTENSIONS.bits()
        | Cr4Flags::OSFXSR.bits()
        | Cr4Flags::OSXMMEXCPT_ENABLE.bits()
        | xsave)
        & cr4_fixed1;
    if cr4 & Cr4Flags::VIRTUAL_MACHINE_EXTENSIONS.bits() == 0 {
        return Err(Error::Fixed("CR4"));
    }
    if cr0 & Cr0Flags::PAGING.bits() == 0 {
        return Err(Error::Fixed("CR0"));
    }
    // SAFETY: the new values keep paging, protection and the current page tables (only fixed
    // bits required by VMX and CR4.VMXE/OSFXSR/OSXMMEXCPT are added), so execution continues
    // unchanged.
    unsafe {
        Cr0::write_raw(cr0);
        Cr4::write_raw(cr4);
    }

    // §25.11.5: the VMXON region is 4 KiB aligned, its first 31 bits hold the VMCS revision
    // identifier, and it must be write-back memory (memory type 6 was checked in the caps).
    let region = memory::alloc_zeroed(4096, 4096).ok_or(Error::NoMemory)?;
    // SAFETY: `region` is a fresh, identity-mapped, 4 KiB frame owned by this CPU from now on.
    unsafe { core::ptr::write_volatile(region as *mut u32, caps.vmcs_revision()) };
    // SAFETY: CR4.VMXE is set, the CR0/CR4 fixed bits hold, IA32_FEATURE_CONTROL allows VMXON,
    // and the region is prepared as §24.7 requires.
    unsafe { instructions::vmxon(region) }.map_err(Error::Vmxon)?;
    Ok(region)
}
