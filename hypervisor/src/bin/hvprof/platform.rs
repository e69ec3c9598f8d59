//! The CPU report and the refusals: what this CPU offers for VMX, EPT and profiling, and a clear
//! "refused" line when it lacks something hvprof cannot run without.

use crate::arch::msr;
use crate::println;
use core::fmt;
use hvprof_pmu::probe::{self, PmuInfo, Probe};
use hvprof_vmx::caps::{FeatureControl, RawCaps, Report, VmxCaps, msr as vmsr};
use raw_cpuid::CpuId;

/// Why hvprof will not start on this CPU.
pub enum Refusal {
    NoVmx { svm: bool },
    VmxLockedOff,
    CapsUnreadable(probe::MsrFault),
    Missing(hvprof_vmx::caps::Missing),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NoVmx { svm: true } => f.write_str(
                "this CPU has no VMX (Intel VT-x); it has AMD SVM, which hvprof does not support",
            ),
            Refusal::NoVmx { svm: false } => {
                f.write_str("this CPU has no VMX (Intel VT-x): CPUID.1:ECX.VMX[bit 5] = 0")
            }
            Refusal::VmxLockedOff => f.write_str(
                "VMX is disabled and locked in IA32_FEATURE_CONTROL (enable Intel VT-x in the firmware setup)",
            ),
            Refusal::CapsUnreadable(fault) => {
                write!(f, "the VMX capability MSRs cannot be read ({fault})")
            }
            Refusal::Missing(m) => write!(f, "{m}"),
        }
    }
}

/// What the rest of the hypervisor needs to know about this CPU (the VMX core, next, reads it).
#[allow(dead_code)]
pub struct CpuReport {
    pub vmx: VmxCaps,
    pub feature_control: FeatureControl,
    pub pmu: Probe,
    pub pmu_info: PmuInfo,
}

/// Prints the CPU lines of the boot report and decides whether hvprof can run here.
pub fn report() -> Result<CpuReport, Refusal> {
    let cpuid = CpuId::new();
    let vendor = cpuid.get_vendor_info();
    let features = cpuid.get_feature_info();
    let brand = cpuid.get_processor_brand_string();
    let (family, model, stepping) = features.as_ref().map_or((0, 0, 0), |f| {
        (f.family_id(), f.model_id(), f.stepping_id())
    });
    println!(
        "cpu: {} family {family} model {model} stepping {stepping} \"{}\"",
        vendor.as_ref().map_or("unknown vendor", |v| v.as_str()),
        brand.as_ref().map_or("", |b| b.as_str().trim()),
    );
    let svm = cpuid
        .get_extended_processor_and_feature_identifiers()
        .is_some_and(|e| e.has_svm());
    let vmx = features.as_ref().is_some_and(|f| f.has_vmx());
    if !vmx {
        println!("cpu: VMX no");
        return Err(Refusal::NoVmx { svm });
    }
    let feature_control = FeatureControl(
        msr::read_safe(vmsr::IA32_FEATURE_CONTROL).map_err(Refusal::CapsUnreadable)?,
    );
    println!(
        "cpu: VMX yes (IA32_FEATURE_CONTROL {:#x}: {}, VMX outside SMX {})",
        feature_control.0,
        if feature_control.locked() {
            "locked"
        } else {
            "unlocked"
        },
        if feature_control.vmx_outside_smx() {
            "enabled"
        } else {
            "disabled"
        },
    );
    if feature_control.vmx_locked_off() {
        return Err(Refusal::VmxLockedOff);
    }
    let caps = VmxCaps::new(read_caps().map_err(Refusal::CapsUnreadable)?);
    println!("{}", Report(&caps));
    let (pmu, pmu_info) = probe_pmu(&cpuid);
    if let Some(missing) = caps.missing_requirement() {
        return Err(Refusal::Missing(missing));
    }
    Ok(CpuReport {
        vmx: caps,
        feature_control,
        pmu,
        pmu_info,
    })
}

/// Reads the capability MSRs, each only when the SDM says it exists (Vol. 3D Appendix A).
fn read_caps() -> Result<RawCaps, probe::MsrFault> {
    let r = msr::read_safe;
    let mut raw = RawCaps {
        basic: r(vmsr::IA32_VMX_BASIC)?,
        pinbased: r(vmsr::IA32_VMX_PINBASED_CTLS)?,
        procbased: r(vmsr::IA32_VMX_PROCBASED_CTLS)?,
        exit: r(vmsr::IA32_VMX_EXIT_CTLS)?,
        entry: r(vmsr::IA32_VMX_ENTRY_CTLS)?,
        misc: r(vmsr::IA32_VMX_MISC)?,
        ..RawCaps::default()
    };
    let partial = VmxCaps::new(raw);
    if partial.has_true_controls() {
        raw.true_pinbased = r(vmsr::IA32_VMX_TRUE_PINBASED_CTLS)?;
        raw.true_procbased = r(vmsr::IA32_VMX_TRUE_PROCBASED_CTLS)?;
        raw.true_exit = r(vmsr::IA32_VMX_TRUE_EXIT_CTLS)?;
        raw.true_entry = r(vmsr::IA32_VMX_TRUE_ENTRY_CTLS)?;
    }
    if partial.has_secondary() {
        raw.procbased2 = r(vmsr::IA32_VMX_PROCBASED_CTLS2)?;
        let c2 = VmxCaps::new(raw);
        if c2.has_ept() || c2.has_vpid() {
            raw.ept_vpid = r(vmsr::IA32_VMX_EPT_VPID_CAP)?;
        }
    }
    Ok(raw)
}

/// Probes the PMU functionally and prints the `pmu:` line.
fn probe_pmu(cpuid: &CpuId<raw_cpuid::CpuIdReaderNative>) -> (Probe, PmuInfo) {
    let info = if cpuid
        .get_vendor_info()
        .is_some_and(|v| v.as_str() == "GenuineIntel")
        && cpuid.get_feature_info().is_some()
    {
        let leaf = raw_cpuid::native_cpuid::cpuid_count(0xa, 0);
        let max_leaf = raw_cpuid::native_cpuid::cpuid_count(0, 0).eax;
        if max_leaf >= 0xa {
            PmuInfo::from_cpuid(leaf.eax, leaf.edx)
        } else {
            PmuInfo::default()
        }
    } else {
        PmuInfo::default()
    };
    let result = probe::probe(&info, &mut msr::SafeMsrs, probe_workload);
    let verdict = if result.counting() {
        "counting"
    } else {
        "not counting"
    };
    println!("pmu: {verdict} ({info}; probe: {result})");
    (result, info)
}

/// About 10,000 instructions of work the optimiser cannot remove.
fn probe_workload() {
    let mut x = 1u64;
    for i in 0..2_000u64 {
        x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    core::hint::black_box(x);
}
