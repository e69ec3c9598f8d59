//! The end-to-end scenarios, and the serial-log text they look for.
//!
//! Every line prefix a check relies on lives in [`expect`]: when the hypervisor's wording
//! changes, adjust it there.
//!
//! To add a scenario, append one to [`all`]:
//! ```text
//! Scenario::new("bochs-skylake-2cpu", Emulator::bochs("corei7_skylake_x"))
//!     .cpus(2)
//!     .cmdline("period=1ms")
//!     .module("hello.elf", ModuleSource::Guest("hello"), "vm=hello")
//!     .check(|log| check_full_boot(log, 2, PmuExpect::NotCounting))
//! ```
//! A check gets the [`SerialLog`] and returns `Err(reason)`; [`SerialLog::expect`] and its
//! siblings give reasons that name the missing line. The end marker (default
//! `hvprof: power off`) and the timeout (the emulator's default) can be changed per scenario.

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::runner::{ModuleSource, Scenario};

/// The serial-log text the checks look for.
pub mod expect {
    /// The banner: `hvprof 0.1.0 build-id <40 hex digits>`.
    pub const BANNER: &str = "hvprof ";
    /// The word before the build id in the banner.
    pub const BUILD_ID: &str = "build-id";
    /// Hex digits in a GNU build id (SHA-1).
    pub const BUILD_ID_HEX_DIGITS: usize = 40;
    /// A memory map line: `memory: 0x...-0x... available`.
    pub const MEMORY_MAP: &str = "memory: 0x";
    /// The usable-memory summary.
    pub const MEMORY_USABLE: &str = "memory: usable ";
    /// The report of a module: `module <n>: ...`.
    pub fn module(n: usize) -> String {
        format!("module {n}: ")
    }
    /// A module report that starts with this is a rejected module.
    pub const MODULE_ERROR: &str = "error:";
    /// The MADT summary with `n` CPUs.
    pub fn madt_cpus(n: u32) -> String {
        format!("acpi: MADT: {n} CPUs")
    }
    /// CPU features the haswell model has.
    pub const CPU_VMX: &str = "cpu: VMX yes";
    /// EPT present.
    pub const CPU_EPT: &str = "cpu: EPT yes";
    /// VPID present.
    pub const CPU_VPID: &str = "cpu: VPID yes";
    /// Unrestricted guest present.
    pub const CPU_UNRESTRICTED: &str = "cpu: unrestricted guest yes";
    /// VMX-preemption timer present.
    pub const CPU_PREEMPTION_TIMER: &str = "cpu: VMX-preemption timer yes";
    /// The PMU was found not to count (Bochs, QEMU TCG).
    pub const PMU_NOT_COUNTING: &str = "pmu: not counting";
    /// The PMU counts (real hardware, nested KVM with `pmu=on`).
    pub const PMU_COUNTING: &str = "pmu: counting";
    /// A clear refusal to run on this CPU.
    pub const REFUSED: &str = "hvprof: refused:";
    /// A bad boot option.
    pub const UNKNOWN_OPTION: &str = "hvprof: error: unknown boot option";
    /// The hypervisor is up.
    pub const READY: &str = "hvprof: ready";
    /// The last line.
    pub const POWER_OFF: &str = "hvprof: power off";
    /// An unexpected CPU exception in the hypervisor: `EXCEPTION: #UD ...`.
    pub const EXCEPTION: &str = "EXCEPTION: ";
    /// A Rust panic in the hypervisor.
    pub const PANIC: &str = "PANIC:";
    /// In a register dump: the instruction pointer.
    pub const REG_RIP: &str = "RIP=";
    /// In a register dump: the page-fault address.
    pub const REG_CR2: &str = "CR2=";
}

/// The Bochs model with everything the hypervisor needs.
pub const HASWELL: &str = "corei7_haswell_4770";
/// A Bochs model with VMX but no EPT.
pub const PENRYN: &str = "core2_penryn_t9600";
/// A Bochs model with SVM only.
pub const RYZEN: &str = "ryzen";

/// The valid module every booting scenario carries: the `hello` test guest, which prints and
/// exits with code 42.
const SAMPLE: &str = "hello.elf";
const SAMPLE_ARGS: &str = "vm=hello";
const SAMPLE_GUEST: ModuleSource = ModuleSource::Guest("hello");

/// Collects every problem a check finds, so one failure names all of them.
#[derive(Default)]
struct Findings(Vec<String>);

impl Findings {
    fn note<T>(&mut self, result: Result<T, String>) {
        if let Err(e) = result {
            self.0.push(e);
        }
    }

    fn finish(self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.0.join("; "))
        }
    }
}

/// The banner, with a 40-hex-digit build id.
pub fn check_banner(log: &SerialLog) -> Result<(), String> {
    let line = log.expect(expect::BANNER)?;
    let id = line
        .split_whitespace()
        .skip_while(|w| *w != expect::BUILD_ID)
        .nth(1)
        .ok_or_else(|| format!("the banner {line:?} has no {:?}", expect::BUILD_ID))?;
    if id.len() == expect::BUILD_ID_HEX_DIGITS && id.chars().all(|c| c.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(format!(
            "the banner's build id {id:?} is not {} hex digits",
            expect::BUILD_ID_HEX_DIGITS
        ))
    }
}

/// Module `n` is reported and was accepted.
pub fn check_module_ok(log: &SerialLog, n: usize, name: &str) -> Result<(), String> {
    let prefix = expect::module(n);
    let line = log.expect_containing(&prefix, name)?;
    if line.contains(expect::MODULE_ERROR) {
        Err(format!("module {n} was rejected: {line:?}"))
    } else {
        Ok(())
    }
}

/// Module `n` was rejected with an error.
pub fn check_module_error(log: &SerialLog, n: usize) -> Result<(), String> {
    log.expect(&format!("{}{}", expect::module(n), expect::MODULE_ERROR))
        .map(drop)
}

/// The power-off line ends the log's story.
fn check_power_off(log: &SerialLog) -> Result<(), String> {
    log.expect(expect::POWER_OFF).map(drop)
}

/// What the PMU line may say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PmuExpect {
    /// Emulators without a counting PMU.
    NotCounting,
    /// Either (nested KVM counts where the host lets it).
    Either,
}

/// A full boot on a CPU with everything: banner, memory, module 0, VMX features, PMU, MADT with
/// `cpus` CPUs, ready, power off.
pub fn check_full_boot(log: &SerialLog, cpus: u32, pmu: PmuExpect) -> Result<(), String> {
    let mut f = Findings::default();
    f.note(check_banner(log));
    f.note(log.expect(expect::MEMORY_MAP));
    f.note(log.expect(expect::MEMORY_USABLE));
    f.note(check_module_ok(log, 0, SAMPLE));
    for feature in [
        expect::CPU_VMX,
        expect::CPU_EPT,
        expect::CPU_VPID,
        expect::CPU_UNRESTRICTED,
        expect::CPU_PREEMPTION_TIMER,
    ] {
        f.note(log.expect(feature));
    }
    f.note(match pmu {
        PmuExpect::NotCounting => log.expect(expect::PMU_NOT_COUNTING).map(drop),
        PmuExpect::Either => {
            if log.has_line_starting(expect::PMU_COUNTING)
                || log.has_line_starting(expect::PMU_NOT_COUNTING)
            {
                Ok(())
            } else {
                Err(format!(
                    "no line starting with {:?} or {:?}",
                    expect::PMU_COUNTING,
                    expect::PMU_NOT_COUNTING
                ))
            }
        }
    });
    f.note(log.expect(&expect::madt_cpus(cpus)));
    f.note(log.expect_none(expect::REFUSED));
    f.note(log.expect_after(expect::READY, expect::POWER_OFF));
    f.note(crate::vm_scenarios::check_exit_code(
        log,
        "hello",
        42,
        "port 0xf4",
    ));
    f.finish()
}

/// A clear refusal naming `missing`, no ready line, then power off.
pub fn check_refusal(log: &SerialLog, missing: &str) -> Result<(), String> {
    let mut f = Findings::default();
    f.note(check_banner(log));
    f.note(log.expect_containing(expect::REFUSED, missing));
    f.note(log.expect_none(expect::READY));
    f.note(log.expect_after(expect::REFUSED, expect::POWER_OFF));
    f.finish()
}

/// The bad option is named, the hypervisor does not start, and powers off.
pub fn check_unknown_option(log: &SerialLog, option: &str) -> Result<(), String> {
    let mut f = Findings::default();
    f.note(log.expect(&format!("{} '{option}'", expect::UNKNOWN_OPTION)));
    f.note(log.expect_none(expect::READY));
    f.note(check_power_off(log));
    f.finish()
}

/// An exception report `EXCEPTION: <vector>` followed by a register dump holding each of
/// `registers`, then power off.
pub fn check_exception(log: &SerialLog, vector: &str, registers: &[&str]) -> Result<(), String> {
    let mut f = Findings::default();
    let prefix = format!("{}{vector}", expect::EXCEPTION);
    match log.expect(&prefix) {
        Ok(line) => {
            let mut dump = vec![line];
            dump.extend(
                log.lines_after(&prefix)
                    .into_iter()
                    .take_while(|l| !l.starts_with(expect::POWER_OFF)),
            );
            for reg in registers {
                if !dump.iter().any(|l| l.contains(reg)) {
                    f.note::<()>(Err(format!(
                        "the register dump after {line:?} has no {reg:?}"
                    )));
                }
            }
        }
        Err(e) => f.note::<()>(Err(e)),
    }
    f.note(check_power_off(log));
    f.finish()
}

/// A panic report, then power off.
pub fn check_panic(log: &SerialLog) -> Result<(), String> {
    let mut f = Findings::default();
    f.note(log.expect(expect::PANIC));
    f.note(log.expect_after(expect::PANIC, expect::POWER_OFF));
    f.finish()
}

/// 4 KiB of deterministic garbage starting with `NOTELF`: a module that is no ELF.
pub fn garbage_module() -> Vec<u8> {
    let mut bytes = b"NOTELF".to_vec();
    let mut state: u32 = 0x1234_5678;
    while bytes.len() < 4096 {
        // xorshift32
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        bytes.push(state.to_le_bytes()[0]);
    }
    bytes
}

fn full_boot(name: &str, emulator: Emulator, cpus: u32, pmu: PmuExpect) -> Scenario {
    Scenario::new(name, emulator)
        .cpus(cpus)
        .module(SAMPLE, SAMPLE_GUEST, SAMPLE_ARGS)
        .check(move |log| check_full_boot(log, cpus, pmu))
}

fn refusal(name: &str, emulator: Emulator, missing: &'static str) -> Scenario {
    Scenario::new(name, emulator)
        .module(SAMPLE, SAMPLE_GUEST, SAMPLE_ARGS)
        .check(move |log| check_refusal(log, missing))
}

fn selftest(kind: &str, check: fn(&SerialLog) -> Result<(), String>) -> Scenario {
    Scenario::new(&format!("bochs-selftest-{kind}"), Emulator::bochs(HASWELL))
        .cmdline(&format!("selftest={kind}"))
        .check(check)
}

/// Every end-to-end scenario.
pub fn all() -> Vec<Scenario> {
    vec![
        full_boot(
            "bochs-haswell-1cpu",
            Emulator::bochs(HASWELL),
            1,
            PmuExpect::NotCounting,
        ),
        full_boot(
            "bochs-haswell-2cpu",
            Emulator::bochs(HASWELL),
            2,
            PmuExpect::NotCounting,
        ),
        refusal("bochs-penryn-no-ept", Emulator::bochs(PENRYN), "EPT"),
        refusal("bochs-ryzen-no-vmx", Emulator::bochs(RYZEN), "VMX"),
        refusal("qemu-tcg-bios-no-vmx", Emulator::QemuTcgBios, "VMX"),
        refusal("qemu-tcg-uefi-no-vmx", Emulator::QemuTcgUefi, "VMX"),
        // A module that is no ELF, and an ELF that passes the header checks but does not fit
        // in its VM's memory (the hypervisor's own image, linked at 16 MiB): both refused with a
        // message, and the good guest after them still runs. That guest names a truncated
        // unwind table and a missing one: both reported and left out, and it runs.
        Scenario::new("bochs-malformed-module", Emulator::bochs(HASWELL))
            .module(SAMPLE, SAMPLE_GUEST, SAMPLE_ARGS)
            .module("bad.elf", ModuleSource::Bytes(garbage_module()), "vm=bad")
            .module(
                "toobig.elf",
                ModuleSource::HypervisorCopy,
                "vm=toobig mem=16M",
            )
            .module(
                "hello2.elf",
                SAMPLE_GUEST,
                "vm=hello2 code=9 unwind=cut.unwind,missing.unwind",
            )
            .module(
                "cut.unwind",
                ModuleSource::Bytes([&b"HVUNWND\x01"[..], &[0xff; 40]].concat()),
                "",
            )
            .check(|log| {
                let mut f = Findings::default();
                f.note(check_module_ok(log, 0, SAMPLE));
                f.note(check_module_error(log, 1));
                f.note(log.expect_containing("module 1: error:", "not an ELF image"));
                f.note(log.expect_containing("vm toobig: error:", "does not fit in guest memory"));
                f.note(
                    log.expect_containing(
                        "vm hello2: error: unwind table cut.unwind:",
                        "truncated",
                    ),
                );
                f.note(log.expect_containing(
                    "vm hello2: error: unwind=missing.unwind:",
                    "no boot module of that name; left out",
                ));
                f.note(log.expect_after(expect::READY, expect::POWER_OFF));
                f.note(crate::vm_scenarios::check_exit_code(
                    log,
                    "hello",
                    42,
                    "port 0xf4",
                ));
                f.note(crate::vm_scenarios::check_exit_code(
                    log,
                    "hello2",
                    9,
                    "port 0xf4",
                ));
                f.finish()
            }),
        Scenario::new("bochs-unknown-option", Emulator::bochs(HASWELL))
            .cmdline("period=1ms bogus=1")
            .check(|log| check_unknown_option(log, "bogus")),
        selftest("ud", |log| check_exception(log, "#UD", &[expect::REG_RIP])),
        selftest("pagefault", |log| {
            check_exception(log, "#PF", &[expect::REG_RIP, expect::REG_CR2])
        }),
        selftest("panic", check_panic),
        full_boot("qemu-kvm-nested", Emulator::QemuKvm, 2, PmuExpect::Either),
    ]
    .into_iter()
    .chain(crate::vm_scenarios::all())
    .chain(crate::pmu_scenarios::all())
    .chain(crate::profile_scenarios::all())
    .chain(crate::security_scenarios::all())
    .chain(crate::linux_scenarios::all())
    .chain(crate::smp_scenarios::all())
    .chain(crate::channel_scenarios::all())
    .chain(crate::live_scenarios::all())
    .chain(crate::stack_scenarios::all())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef01234567";

    fn full_log(cpus: u32) -> String {
        let madt = if cpus == 1 {
            "acpi: MADT: 1 CPUs: apic-id 0 (boot CPU)".to_owned()
        } else {
            format!("acpi: MADT: {cpus} CPUs: apic-id 0 (boot CPU), apic-id 1")
        };
        format!(
            "hvprof 0.1.0 build-id {ID}\r\n\
             boot: loader \"GRUB 2.06\"   cmdline \"\"\r\n\
             options: period=1ms export=stream selftest=none serial=0x3f8\r\n\
             memory: 0x0000000000000000-0x000000000009fc00 available\r\n\
             memory: usable 511 MiB, 130000 free frames after excluding the image, the boot info and 1 modules\r\n\
             module 0: hello.elf 0x400000-0x500000 1048576 bytes, args \"vm=hello\": ELF64 x86-64 executable, entry 0x200000\r\n\
             acpi: RSDP v2 at 0xf0000, OEM \"BOCHS \"\r\n\
             {madt}\r\n\
             acpi: FADT: PM1a_CNT 0xb004, S5 sleep type 0\r\n\
             cpu: GenuineIntel family 6 model 60 \"Intel(R) Core(TM) i7-4770 CPU\"\r\n\
             cpu: VMX yes (basic 0x00d810000000002b)\r\n\
             cpu: EPT yes (4-level, 2M, 1G, A/D)\r\n\
             cpu: VPID yes\r\n\
             cpu: unrestricted guest yes\r\n\
             cpu: VMX-preemption timer yes (shift 0)\r\n\
             pmu: not counting (counter 0 did not move)\r\n\
             hvprof: ready ({cpus} CPUs)\r\n\
             vm hello: stopped: exit code 42 (port 0xf4) after 47385 ticks\r\n\
             hvprof: power off (acpi)\r\n"
        )
    }

    #[test]
    fn full_boot_passes_on_a_good_log() {
        for cpus in [1, 2] {
            let log = SerialLog::new(full_log(cpus));
            assert_eq!(check_full_boot(&log, cpus, PmuExpect::NotCounting), Ok(()));
            assert_eq!(check_full_boot(&log, cpus, PmuExpect::Either), Ok(()));
        }
    }

    #[test]
    fn full_boot_catches_wrong_cpu_count_and_missing_features() {
        let log = SerialLog::new(full_log(1));
        let err = check_full_boot(&log, 2, PmuExpect::NotCounting).unwrap_err();
        assert!(err.contains("acpi: MADT: 2 CPUs"), "{err}");
        let log = SerialLog::new(full_log(2).replace("cpu: EPT yes", "cpu: EPT no"));
        let err = check_full_boot(&log, 2, PmuExpect::NotCounting).unwrap_err();
        assert!(err.contains("cpu: EPT yes"), "{err}");
        let log = SerialLog::new(full_log(1).replace("pmu: not counting", "pmu: counting"));
        assert!(check_full_boot(&log, 1, PmuExpect::NotCounting).is_err());
        assert!(check_full_boot(&log, 1, PmuExpect::Either).is_ok());
        let log = SerialLog::new(full_log(1).replace(ID, "abc"));
        let err = check_full_boot(&log, 1, PmuExpect::NotCounting).unwrap_err();
        assert!(err.contains("build id"), "{err}");
        let log =
            SerialLog::new(full_log(1).replace("module 0: hello.elf", "module 0: error: bad"));
        assert!(check_full_boot(&log, 1, PmuExpect::NotCounting).is_err());
    }

    #[test]
    fn full_boot_wants_ready_before_power_off() {
        let text = full_log(1).replace("hvprof: ready (1 CPUs)\r\n", "");
        let log = SerialLog::new(format!("{text}hvprof: ready (1 CPUs)\r\n"));
        assert!(check_full_boot(&log, 1, PmuExpect::NotCounting).is_err());
    }

    #[test]
    fn refusal_checks() {
        let log = SerialLog::new(format!(
            "hvprof 0.1.0 build-id {ID}\n\
             cpu: VMX yes\ncpu: EPT no\n\
             hvprof: refused: this CPU has no EPT (secondary controls lack \"enable EPT\")\n\
             hvprof: power off (port 0x8900)\n"
        ));
        assert_eq!(check_refusal(&log, "EPT"), Ok(()));
        let err = check_refusal(&log, "VMX").unwrap_err();
        assert!(err.contains("VMX"), "{err}");
        let log = SerialLog::new(format!("{}hvprof: ready (1 CPUs)\n", log.text()));
        assert!(check_refusal(&log, "EPT").is_err());
    }

    #[test]
    fn unknown_option_checks() {
        let good = SerialLog::new(format!(
            "hvprof 0.1.0 build-id {ID}\n\
             hvprof: error: unknown boot option 'bogus' (known: period, export, selftest, serial)\n\
             hvprof: power off (acpi)\n"
        ));
        assert_eq!(check_unknown_option(&good, "bogus"), Ok(()));
        let started = SerialLog::new(format!("{}hvprof: ready (1 CPUs)\n", good.text()));
        assert!(check_unknown_option(&started, "bogus").is_err());
    }

    #[test]
    fn exception_and_panic_checks() {
        let pf = SerialLog::new(
            "EXCEPTION: #PF (vector 14) error code 0x2\n\
             RIP=0x0000000000201234 RSP=0x0000000000310000\n\
             CR2=0x0000dead0000beef CR3=0x1000\n\
             hvprof: power off (acpi)\n",
        );
        assert_eq!(
            check_exception(&pf, "#PF", &[expect::REG_RIP, expect::REG_CR2]),
            Ok(())
        );
        assert!(check_exception(&pf, "#UD", &[expect::REG_RIP]).is_err());
        let no_cr2 = SerialLog::new(pf.text().replace("CR2=", "CRX="));
        let err = check_exception(&no_cr2, "#PF", &[expect::REG_RIP, expect::REG_CR2]).unwrap_err();
        assert!(err.contains("CR2="), "{err}");
        let panic = SerialLog::new(
            "PANIC: selftest panic at hypervisor/src/selftest.rs:10\nhvprof: power off (acpi)\n",
        );
        assert_eq!(check_panic(&panic), Ok(()));
        assert!(check_panic(&pf).is_err());
    }

    #[test]
    fn malformed_module_check() {
        let scenarios = all();
        let s = scenarios
            .iter()
            .find(|s| s.name == "bochs-malformed-module")
            .unwrap();
        let good = SerialLog::new(
            "module 0: hello.elf 0x1-0x2 1 bytes, args \"vm=hello\": ELF64 x86-64 executable, entry 0x1\n\
             module 1: error: 'bad.elf' (0x2-0x3, 1 bytes) is not a loadable guest image: not an ELF image (bad magic)\n\
             vm toobig: error: ELF segment 0 (0x1000000-0x1060000) does not fit in guest memory [0x100000, 0x1000000); VM not created, the others go on\n\
             vm hello2: error: unwind table cut.unwind: truncated: shorter than its counts say; left out\n\
             vm hello2: error: unwind=missing.unwind: no boot module of that name; left out\n\
             hvprof: ready (1 CPUs)\n\
             vm hello: stopped: exit code 42 (port 0xf4) after 1 ticks\n\
             vm hello2: stopped: exit code 9 (port 0xf4) after 1 ticks\n\
             hvprof: power off (acpi)\n",
        );
        assert_eq!((s.check)(&good), Ok(()));
        let bad = SerialLog::new(good.text().replace("module 1: error:", "module 1: bad.elf"));
        assert!((s.check)(&bad).is_err());
    }

    #[test]
    fn garbage_is_deterministic_and_not_elf() {
        let a = garbage_module();
        assert_eq!(a.len(), 4096);
        assert!(a.starts_with(b"NOTELF"));
        assert_eq!(a, garbage_module());
        assert!(!a.starts_with(b"\x7fELF"));
    }

    #[test]
    fn scenario_names_are_unique_and_budgets_follow_the_emulator() {
        let list = all();
        let mut names: Vec<&str> = list.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), list.len());
        // The Linux guests boot a whole kernel first: they set their own, larger budgets; a few
        // long runs (the task flood) set a larger one too. None sets less than its emulator's.
        for s in list.iter().filter(|s| !s.name.contains("linux")) {
            let least = match s.emulator {
                Emulator::Bochs { .. } | Emulator::QemuTcgUefi => 60,
                Emulator::QemuTcgBios | Emulator::QemuKvm => 30,
            };
            assert!(s.budget.as_secs() >= least, "{}", s.name);
        }
    }
}
