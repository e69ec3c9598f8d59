//! Linux guests end to end (the paper's Tables 3-4): Debian's cloud kernel and an initramfs with
//! static workloads (`cargo xtask linux-image` builds them into `target/linux/`) boot under the
//! hypervisor in Bochs; `hvprof-analyze` names the guest's kernel functions (kallsyms rebuilt
//! from the image, KASLR slide from the guest's IA32_LSTAR) and processes (task frames), and the
//! workload's function shares are checked against the ground truth measured natively on the
//! host (`target/linux/truth.json`, written by `cargo xtask linux-truth` with the commands that
//! produced it).
//!
//! Bochs' clock counts instructions, so a sample falls on an instruction with equal probability:
//! the truth to compare with is the instruction count per function (callgrind). For the 4:1
//! workload it equals native `perf record -e cpu-clock` within half a point; for libquantum, real
//! CPUs run some functions at very different IPC, so cpu-clock shares differ from instruction
//! shares and only hardware sampling (real VMX or nested KVM with a PMU) can match them.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::SerialLog;
use crate::emulator::Emulator;
use crate::profile::{ProfileRun, num, vm, within};
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::{all_of, check_exit_code};

/// Where `cargo xtask linux-image` puts the kernel, the initramfs and the manifest.
pub fn linux_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .map(|p| p.join("target"))
                .unwrap_or_else(|| PathBuf::from("target"))
        });
    target.join("linux")
}

/// The kernel command line of a Linux VM without `apic=on`: serial console, the devices the
/// hypervisor emulates (8259, 8254, 16550; no ACPI, no local APIC), quiet, no self-tests. Every
/// Linux scenario runs with `apic=on` and this line less `acpi=off nolapic` (local APICs, the I/O
/// APIC, ACPI tables).
/// `tsc=reliable`: with no other clocksource to check the TSC against (no HPET, no ACPI PM
/// timer), the kernel would fall back to jiffies. `highres=off nohz=off`: a periodic tick from
/// the PIT (mode 2, one write at boot) instead of a one-shot PIT reprogrammed for every timer
/// event, which costs three trapped port writes each time (hvprof's own profile of the boot
/// showed `pit_next_event` and half the time in the hypervisor). `no_timer_check`: the I/O APIC
/// set-up's check that the timer ticks (`timer_irq_works`, busy-waiting for ten ticks: 2.5% of a
/// boot in hvprof's profile) is skipped, as KVM's guests skip it. `initcall_blacklist=`: three
/// start-up jobs of the tracing subsystem that the guests never use, a fifth of a boot's
/// instructions in hvprof's profile of the boot (`bochs-linux-stacks`, by the initcall or work
/// function below each sample): the check of every ftrace record against kallsyms for weak
/// functions (`ftrace_check_work_func`, 9 %), tracefs's files for every trace event
/// (`tracer_init_tracefs_work_func`, 7 %) and the enum names in the events' formats
/// (`trace_event_update_all`, 4 %). Without them the guest has no /sys/kernel/tracing, and
/// function tracing may patch a weak function's stub; nothing else changes.
pub const KERNEL_CMDLINE: &str = "console=ttyS0 acpi=off nolapic tsc=reliable highres=off nohz=off no_timer_check quiet mitigations=off cryptomgr.notests initcall_blacklist=ftrace_check_for_weak_functions,tracer_init_tracefs,trace_eval_init";

/// The kernel's keys for the hypervisor (`linux_guest::ModuleKeys`, the derivation `cargo xtask
/// run --config` uses for a VM's `vmlinux`): `task-offsets=`, and `mm-layout=`,
/// `module-layout=` and `orc-layout=` where the kernel allows them, from the image's vmlinux.
/// Empty when the kernel is missing: the scenario then fails on its missing files, with the
/// command to run. Computed once it exists (the scenario list is also made before `cargo xtask
/// test` builds the image: a missing kernel is not remembered).
fn kernel_keys() -> String {
    static KEYS: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let mut cached = KEYS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(k) = cached.as_ref() {
        return k.clone();
    }
    let Ok(k) = linux_guest::KernelImage::from_vmlinux(linux_dir().join("vmlinux")) else {
        return String::new();
    };
    let keys = k.module_keys().words().join(" ");
    *cached = Some(keys.clone());
    keys
}

/// One Linux VM running `run` with `arg` (module name `<vm>.bzImage`, initrd `<vm>.cpio`).
fn linux_vm(s: Scenario, vm: &str, run: &str, arg: &str) -> Scenario {
    linux_vm_with(s, vm, run, arg, "")
}

/// `linux_vm` with more of /init's options on the kernel command line (`hvprof.modules=`,
/// `hvprof.via=`). One vCPU with its local APIC, the I/O APIC and ACPI tables (`apic=on`): the
/// kernel takes the local APIC's TSC-deadline timer for its tick, where the PIT's took port
/// writes.
fn linux_vm_with(s: Scenario, vm: &str, run: &str, arg: &str, more: &str) -> Scenario {
    linux_module(
        s,
        vm,
        "apic=on",
        &KERNEL_CMDLINE.replace(" acpi=off nolapic", ""),
        &format!("hvprof.run={run} hvprof.arg={arg} {more}"),
    )
}

/// `linux_vm` with every local APIC access trapped and emulated (`apic=emulated`), as on a CPU
/// without APIC virtualization.
fn linux_vm_emulated_apic(s: Scenario, vm: &str, run: &str, arg: &str) -> Scenario {
    linux_module(
        s,
        vm,
        "apic=emulated",
        &KERNEL_CMDLINE.replace(" acpi=off nolapic", ""),
        &format!("hvprof.run={run} hvprof.arg={arg} "),
    )
}

/// The hypervisor's line on VM `vm`'s APIC virtualization: on (`on`), or off because of
/// `apic=emulated`.
pub(crate) fn check_apic_virtualization(log: &SerialLog, vm: &str, on: bool) -> Result<(), String> {
    let want = if on {
        "TPR shadow, APIC-register virtualization, virtual-interrupt delivery"
    } else {
        "off (apic=emulated)"
    };
    log.expect_containing(&format!("vm {vm}: APIC virtualization: "), want)
        .map(|_| ())
}

/// Linux VM `linux` with two vCPUs, local APICs, the I/O APIC and ACPI tables (`apic=on`),
/// pinned as `pin` says, and /init's options `init`: the kernel command line without `acpi=off
/// nolapic`.
pub(crate) fn linux_apic_module(s: Scenario, pin: &str, init: &str) -> Scenario {
    linux_smp_module(s, &format!("apic=on vcpus=2 pin={pin}"), init)
}

/// Linux VM `linux` with the hypervisor's keys `keys` (`apic=on vcpus=N pin=...` and others)
/// and /init's options `init`: the kernel command line without `acpi=off nolapic`.
pub(crate) fn linux_smp_module(s: Scenario, keys: &str, init: &str) -> Scenario {
    linux_module(
        s,
        "linux",
        keys,
        &KERNEL_CMDLINE.replace(" acpi=off nolapic", ""),
        init,
    )
}

/// The kernel and initramfs modules of Linux VM `vm`: the hypervisor's keys (`keys` beside the
/// layouts every Linux scenario passes), the kernel command line, /init's options.
fn linux_module(s: Scenario, vm: &str, keys: &str, kernel: &str, init: &str) -> Scenario {
    let dir = linux_dir();
    let initrd = format!("{vm}.cpio");
    s.module(
        &format!("{vm}.bzImage"),
        ModuleSource::File(dir.join("bzImage")),
        &format!(
            "vm={vm} mem=256M budget=100000000000 initrd={initrd} {keys} {} {kernel} {init}",
            kernel_keys()
        ),
    )
    .module(&initrd, ModuleSource::File(dir.join("initramfs.cpio")), "")
}

/// The `/proc/interrupts` row `name` (`LOC`, `RES`, ...) the guest printed at `when` (`before`
/// or `after` the workload): its per-CPU counts.
fn guest_interrupts(log: &SerialLog, when: &str, name: &str) -> Result<Vec<u64>, String> {
    let prefix = format!("hvprof-guest: interrupts {when} {name}:");
    let line = log
        .lines()
        .find_map(|l| l.split_once(&prefix).map(|(_, rest)| rest.to_owned()))
        .ok_or_else(|| format!("no \"{prefix}\" line"))?;
    Ok(line
        .split_whitespace()
        .map_while(|w| w.parse::<u64>().ok())
        .collect())
}

/// SMP start-up (`bochs-linux-smp-pinned`): the guest counts 2 CPUs online; both CPUs' local timer interrupts
/// grow while w41 runs; the guest took reschedule and function-call IPIs, and the hypervisor
/// counted the IPIs it delivered, the INIT and SIPIs that started the second vCPU among them;
/// all of it with the CPU's APIC virtualization (Bochs has it).
pub(crate) fn check_smp_boot(log: &SerialLog) -> Result<(), String> {
    let mut errors = Vec::new();
    errors.extend(check_apic_virtualization(log, "linux", true).err());
    match log.lines().find(|l| l.contains("hvprof-guest: cpus ")) {
        Some(l) if l.contains("hvprof-guest: cpus 2 online 0-1") => {}
        other => errors.push(format!(
            "the guest's CPUs: {other:?} (expected 2 online, 0-1)"
        )),
    }
    match (
        guest_interrupts(log, "before", "LOC"),
        guest_interrupts(log, "after", "LOC"),
    ) {
        (Ok(a), Ok(b)) if a.len() == 2 && b.len() == 2 => {
            for cpu in 0..2 {
                if b[cpu] <= a[cpu] {
                    errors.push(format!(
                        "CPU {cpu}'s local timer interrupts did not grow: {} then {}",
                        a[cpu], b[cpu]
                    ));
                }
            }
        }
        (a, b) => errors.push(format!("LOC rows: {a:?} then {b:?} (two CPUs expected)")),
    }
    for ipi in ["RES", "CAL"] {
        match guest_interrupts(log, "after", ipi) {
            Ok(v) if v.iter().sum::<u64>() > 0 => {}
            other => errors.push(format!("no {ipi} IPIs taken by the guest: {other:?}")),
        }
    }
    match log.expect("vm linux: local APICs:") {
        Ok(l) => {
            let number = |after: &str| apic_count(l, after);
            if number(" IPIs sent").is_none_or(|n| n < 10) {
                errors.push(format!("too few IPIs delivered: {l}"));
            }
            if !l.contains("1 of 1 application processors started")
                || number(" SIPI").is_none_or(|n| n == 0)
            {
                errors.push(format!("the second vCPU was not started by a SIPI: {l}"));
            }
        }
        Err(e) => errors.push(e),
    }
    all_of(errors.into_iter().map(Err))
}

/// The count just before `after` in the hypervisor's "vm NAME: local APICs: ..." line (` SIPI`:
/// the SIPIs sent, ` NMI)`: the NMIs, ...).
fn apic_count(line: &str, after: &str) -> Option<u64> {
    line.split_once(after).and_then(|(head, _)| {
        head.split_whitespace()
            .last()?
            .trim_start_matches('(')
            .parse()
            .ok()
    })
}

/// The row of IRQ `irq` in the line `/init` printed with `prefix`: its counts per CPU and the
/// chip that takes it.
fn irq_row(log: &SerialLog, prefix: &str, irq: u32) -> Result<(Vec<u64>, String), String> {
    let line = log
        .lines()
        .find_map(|l| l.split_once(prefix).map(|(_, r)| r.to_owned()))
        .ok_or_else(|| format!("no \"{prefix}\" line"))?;
    let mut words = line.split_whitespace();
    if words.next() != Some(&format!("{irq}:")) {
        return Err(format!("{prefix}{line}: not IRQ {irq}'s row"));
    }
    let words: Vec<&str> = words.collect();
    let counts: Vec<u64> = words.iter().map_while(|w| w.parse().ok()).collect();
    let chip = words.get(counts.len()).copied().unwrap_or("").to_owned();
    Ok((counts, chip))
}

/// The legacy devices' interrupts go through the I/O APIC: the guest's `/proc/interrupts`
/// names it as the chip of IRQ 0 (the PIT, on pin 2) and IRQ 4 (COM1), and each was taken
/// (the PIT's while the kernel checked its timer at boot; COM1's for lines written to
/// /dev/ttyS0 with IRQ 4 bound to each CPU in turn). Each went where Linux programmed it: Linux
/// gives an IRQ a vector on the CPUs of its affinity only, so a message the I/O APIC sent to
/// another vCPU would hit a vector with no handler there (`No irq handler for vector`, printed
/// at KERN_EMERG); none is; IRQ 4 was taken on each CPU, and bound to CPU 0, CPU 0 took more of
/// it (while bound, or as the first interrupt after: Linux moves an edge IRQ when it next fires).
pub(crate) fn check_io_apic(log: &SerialLog) -> Result<(), String> {
    let mut errors = Vec::new();
    if let Some(l) = log
        .lines()
        .find(|l| l.contains("No irq handler for vector"))
    {
        errors.push(format!(
            "an interrupt reached a CPU without its vector: {l}"
        ));
    }
    match (
        irq_row(log, "hvprof-guest: irq 4 before: ", 4),
        irq_row(log, "hvprof-guest: irq 4 bound to cpu 0: ", 4),
        irq_row(log, "hvprof-guest: irq 4 bound to cpu 1: ", 4),
    ) {
        (Ok((before, _)), Ok((cpu0, _)), Ok((last, _)))
            if before.len() == 2 && cpu0.len() == 2 && last.len() == 2 =>
        {
            // Linux moves an edge IRQ when it next fires: the first interrupt after a new
            // binding still goes to the CPU of the one before. So CPU 0 takes IRQ 4 while it
            // is bound to it, or (when the lines written then raised no other) as the first
            // interrupt after the binding to CPU 1.
            if (cpu0[0] <= before[0] && last[0] <= cpu0[0]) || last.contains(&0) {
                errors.push(format!(
                    "IRQ 4 per CPU: {before:?} before, {cpu0:?} bound to CPU 0, {last:?} bound to CPU 1: expected CPU 0's count to grow while bound to it or right after, and both CPUs to have taken it"
                ));
            }
        }
        other => errors.push(format!("IRQ 4's rows: {other:?} (two CPUs expected)")),
    }
    for (prefix, irq) in [
        ("hvprof-guest: interrupts after ", 0),
        ("hvprof-guest: irq 4 bound to cpu 1: ", 4),
    ] {
        match irq_row(log, prefix, irq) {
            Ok((counts, chip)) => {
                if chip != "IO-APIC" || counts.iter().sum::<u64>() == 0 {
                    errors.push(format!(
                        "IRQ {irq}: {counts:?} interrupts taken by {chip:?}; expected some, by the IO-APIC"
                    ));
                }
            }
            Err(e) => errors.push(e),
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// Both vCPUs of the SMP guest ran: each has samples of its own, and, pinned to pCPUs of their
/// own, next to no steal.
pub(crate) fn check_smp_profile(run: &ProfileRun) -> Result<(), String> {
    let report = linux_report(run)?;
    let vcpus = crate::smp_scenarios::vcpus(&report)?;
    let samples: Vec<f64> = vcpus
        .iter()
        .map(|v| v.get("samples").and_then(Value::as_f64).unwrap_or(0.0))
        .collect();
    if samples.len() != 2 || samples.iter().any(|&n| n < 100.0) {
        return Err(format!(
            "vCPU samples {samples:?}: expected two vCPUs with hundreds each"
        ));
    }
    // Each vCPU has a pCPU of its own: what it loses is the hypervisor's work on its behalf
    // (its exits), not another vCPU's turn.
    let steal: Vec<f64> = vcpus
        .iter()
        .map(|v| v.get("steal").and_then(Value::as_f64).unwrap_or(f64::NAN))
        .collect();
    if steal.iter().any(|s| s.is_nan() || *s > 3.0) {
        return Err(format!(
            "steal {steal:?} % per vCPU: pinned to pCPUs of their own, expected under 3 %"
        ));
    }
    Ok(())
}

/// Both CPUs printed their backtrace when sysrq asked (the one that asked itself, the other on
/// the NMI IPI it sent), and the hypervisor counted the NMI it delivered.
fn check_nmi_backtrace(log: &SerialLog) -> Result<(), String> {
    let mut errors = Vec::new();
    for cpu in 0..2 {
        let want = format!("hvprof-guest: backtrace NMI backtrace for cpu {cpu}");
        if !log.lines().any(|l| l.contains(&want)) {
            errors.push(format!("no \"{want}\" line: the NMI IPI was not taken"));
        }
    }
    match log.expect("vm linux: local APICs:") {
        Ok(l) => {
            if apic_count(l, " NMI)").is_none_or(|n| n == 0) {
                errors.push(format!("no NMI IPI delivered: {l}"));
            }
        }
        Err(e) => errors.push(e),
    }
    all_of(errors.into_iter().map(Err))
}

/// CPU 1 went offline and came back online (the guest's INIT-SIPI-SIPI to a vCPU that had run),
/// and ran a program bound to it.
fn check_hotplug(log: &SerialLog) -> Result<(), String> {
    let mut errors = Vec::new();
    for (what, want) in [
        ("hotplug offline", "0"),
        ("hotplug online", "0-1"),
        ("hotplug ran on cpu 1:", "rc=0"),
    ] {
        let prefix = format!("hvprof-guest: {what} ");
        let got = log
            .lines()
            .find_map(|l| l.split_once(&prefix).map(|(_, v)| v.trim().to_owned()));
        if got.as_deref() != Some(want) {
            errors.push(format!("\"{prefix}\": {got:?}, expected {want}"));
        }
    }
    match log.expect("vm linux: local APICs:") {
        Ok(l) => {
            if apic_count(l, " INIT,").is_none_or(|n| n < 2) {
                errors.push(format!(
                    "the vCPU brought back online took no second INIT: {l}"
                ));
            }
        }
        Err(e) => errors.push(e),
    }
    all_of(errors.into_iter().map(Err))
}

/// `bochs-linux-smp-halt`: two vCPUs on one pCPU, w41 on one of them: the mostly halted one's
/// blank time is `[idle] (halted)`, apart from its steal (the time it could have run while its
/// peer ran); for both, the sampled idle and steal agree with the exact figures of the
/// scheduling events within 1 point.
fn check_smp_halt(run: &ProfileRun) -> Result<(), String> {
    use crate::smp_scenarios::field;
    let report = linux_report(run)?;
    let vcpus = crate::smp_scenarios::vcpus(&report)?;
    let w41 = |v: &Value| {
        v.get("rows")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|r| str_of(r, "process").starts_with("w41["))
            .filter_map(|r| r.get("samples").and_then(Value::as_f64))
            .sum::<f64>()
    };
    // The mostly halted vCPU is the one with the more exact idle time: which one the guest runs
    // w41 on, and which one does most of the boot (over the whole run, the boot is most of it),
    // is the guest scheduler's choice and differs between images.
    let (busy, halted) = if field(&vcpus[0], "/exact/idle") <= field(&vcpus[1], "/exact/idle") {
        (&vcpus[0], &vcpus[1])
    } else {
        (&vcpus[1], &vcpus[0])
    };
    let summary = |v: &Value| {
        format!(
            "vCPU {}: w41 {} samples, idle {:.1}%, steal {:.1}% (exact: idle {:.1}%, steal {:.1}%)",
            field(v, "/vcpu"),
            w41(v),
            field(v, "/idle"),
            field(v, "/steal"),
            field(v, "/exact/idle"),
            field(v, "/exact/steal")
        )
    };
    let mut errors = Vec::new();
    let (most, least) = (w41(busy).max(w41(halted)), w41(busy).min(w41(halted)));
    if most < 3000.0 || least > 0.05 * most {
        errors.push(format!(
            "w41 should run on one vCPU: {}; {}",
            summary(busy),
            summary(halted)
        ));
    }
    let (idle, steal) = (field(halted, "/idle"), field(halted, "/steal"));
    // (Over the whole run: the boot, where both vCPUs work and idle, is most of it.)
    let idle_enough = idle >= 25.0 && idle >= 2.0 * steal;
    if !idle_enough {
        errors.push(format!(
            "the halted vCPU's blank time should be idle, not steal: {}; the busy one: {}",
            summary(halted),
            summary(busy)
        ));
    }
    errors.extend(crate::smp_scenarios::events_agree(&[
        busy.clone(),
        halted.clone(),
    ]));
    all_of(errors.into_iter().map(Err))
}

/// The analyzer's report with the guest kernel and the workloads' images.
fn linux_report(run: &ProfileRun) -> Result<Value, String> {
    run.report_with(None, &linux_args())
}

/// The analyzer's arguments for a Linux capture: the guest kernel and the workloads' images.
pub(crate) fn linux_args() -> Vec<OsString> {
    let dir = linux_dir();
    let mut extra: Vec<OsString> = vec!["--kernel".into(), dir.join("vmlinux").into()];
    for w in ["w41", "shor", "lockholder", "shootdown"] {
        extra.push("--image".into());
        extra.push(dir.join("bin").join(w).into());
    }
    extra
}

/// The analyzer's arguments for a capture of the dynamic workloads: the guest kernel and the
/// guest's file tree (the programs, libraries and modules it ran, found by the paths and build
/// ids the mapping frames give; no `--image`).
fn root_args() -> Vec<OsString> {
    let dir = linux_dir();
    vec![
        "--kernel".into(),
        dir.join("vmlinux").into(),
        "--guest-root".into(),
        dir.join("root").into(),
    ]
}

/// The rows of a VM's guest-level table.
fn rows(report: &Value, name: &str) -> Result<Vec<Value>, String> {
    vm(report, name)?
        .get("rows")
        .and_then(Value::as_array)
        .cloned()
        .ok_or_else(|| format!("VM {name} has no rows"))
}

fn str_of<'a>(r: &'a Value, k: &str) -> &'a str {
    r.get(k).and_then(Value::as_str).unwrap_or("")
}

/// The instruction-count shares of `workload`'s functions from the ground truth.
fn truth(workload: &str) -> Result<Shares, String> {
    let path = linux_dir().join("truth.json");
    let t: Value = serde_json::from_slice(&std::fs::read(&path).map_err(|e| {
        format!(
            "cannot read {} ({e}): run `cargo xtask linux-truth`",
            path.display()
        )
    })?)
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let f = t
        .pointer(&format!("/instructions/{workload}/functions"))
        .and_then(Value::as_array)
        .ok_or_else(|| format!("{}: no instruction counts for {workload}", path.display()))?;
    Ok(f.iter()
        .map(|x| {
            (
                str_of(x, "symbol").to_owned(),
                x.get("share").and_then(Value::as_f64).unwrap_or(0.0),
            )
        })
        .collect())
}

/// The rows of the workload process `comm` whose module `module` accepts.
fn process_rows<'a>(
    rows: &'a [Value],
    comm: &str,
    module: &dyn Fn(&str) -> bool,
) -> Vec<&'a Value> {
    rows.iter()
        .filter(|r| str_of(r, "process").starts_with(&format!("{comm}[")))
        .filter(|r| module(str_of(r, "module")))
        .collect()
}

/// The workload process's user-mode function shares (percent of its user-mode samples: the rows
/// whose module `user` accepts) and its sample count.
fn user_shares(rows: &[Value], comm: &str, user: &dyn Fn(&str) -> bool) -> (Shares, f64) {
    let mine = process_rows(rows, comm, user);
    let total: f64 = mine
        .iter()
        .filter_map(|r| r.get("samples").and_then(Value::as_f64))
        .sum();
    let mut shares: Vec<(String, f64)> = mine
        .iter()
        .map(|r| {
            (
                str_of(r, "function").to_owned(),
                100.0 * r.get("samples").and_then(Value::as_f64).unwrap_or(0.0) / total.max(1.0),
            )
        })
        .collect();
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    (shares, total)
}

/// What every Linux profile must show: the workload's process named, the top kernel functions
/// named (not addresses), kernel frames under `[guest.kallsyms]`, nothing lost.
fn check_named(report: &Value, vm_name: &str, comm: &str) -> Result<(), String> {
    for what in ["blocks", "samples", "dropped"] {
        if num(report, &format!("/lost/{what}"))? != 0.0 {
            return Err(format!("the log lost {what}"));
        }
    }
    let rows = rows(report, vm_name)?;
    if !rows
        .iter()
        .any(|r| str_of(r, "process").starts_with(&format!("{comm}[")))
    {
        return Err(format!("no row names the process {comm}"));
    }
    let kernel: Vec<&Value> = rows
        .iter()
        .filter(|r| str_of(r, "module") == "[guest.kallsyms]")
        .take(10)
        .collect();
    if kernel.len() < 5 {
        return Err(format!(
            "only {} kernel functions in VM {vm_name}'s table",
            kernel.len()
        ));
    }
    let hex: Vec<&str> = kernel
        .iter()
        .map(|r| str_of(r, "function"))
        .filter(|f| f.starts_with("[unknown]"))
        .collect();
    if !hex.is_empty() {
        return Err(format!(
            "top kernel functions not named: {}",
            hex.join(", ")
        ));
    }
    Ok(())
}

/// Tables 3-4 with the 4:1 workload: work_a and work_b within 3 points of the native truth; the
/// kernel's and the hypervisor's shares close to what the workload costs natively.
fn check_w41(run: &ProfileRun) -> Result<(), String> {
    let (shares, truth) = workload_shares(run, "w41")?;
    all_of(
        ["work_a", "work_b"]
            .iter()
            .map(|f| {
                within(
                    &format!("w41 {f} share of its user samples"),
                    share(&shares, f),
                    share(&truth, f),
                    3.0,
                )
            })
            .chain([
                check_native_costs(run, "w41"),
                // Kernel symbols (the KASLR slide from LSTAR), exit tables and the whole cost
                // come from frames: a reworded console changes nothing.
                crate::profile::check_console_is_not_read(run, &linux_args()),
                check_mapping(run, "w41"),
            ]),
    )
}

/// The hypervisor read the workload's executable mapping from guest memory: a mapping frame
/// for `/bin/<workload>` in the process that the task frames name `<workload>`, whose range is
/// the static binary's executable segment (page-aligned) and whose build id is the file's.
fn check_mapping(run: &ProfileRun, workload: &str) -> Result<(), String> {
    use object::{Object, ObjectSegment};
    let d = hvprof_samplelog::decode(&run.capture);
    let path = format!("/bin/{workload}");
    let tgids: Vec<u32> = d
        .tasks
        .iter()
        .filter(|t| t.comm.as_str() == workload)
        .map(|t| t.tgid)
        .collect();
    let m = d
        .mappings
        .iter()
        .find(|m| m.path.as_str() == path && tgids.contains(&m.tgid))
        .ok_or_else(|| {
            format!(
                "no mapping frame for {path} in process {tgids:?}; mappings: {:?}",
                d.mappings
                    .iter()
                    .map(|m| (m.tgid, m.path.as_str()))
                    .collect::<Vec<_>>()
            )
        })?;
    let bytes = std::fs::read(linux_dir().join("bin").join(workload))
        .map_err(|e| format!("cannot read the workload: {e}"))?;
    let elf = object::File::parse(&*bytes).map_err(|e| format!("the workload: {e}"))?;
    let text = elf
        .segments()
        .find(|s| {
            matches!(s.flags(), object::SegmentFlags::Elf { p_flags, .. } if p_flags.0 & object::elf::PF_X.0 != 0)
        })
        .ok_or("the workload has no executable segment")?;
    let want = (
        text.address() & !0xfff,
        (text.address() + text.size() + 0xfff) & !0xfff,
        text.file_range().0 / 4096,
    );
    if (m.start, m.end, m.pgoff) != want {
        return Err(format!(
            "{path}: mapping {:#x}..{:#x} page {} read from guest memory, the file says {:#x}..{:#x} page {}",
            m.start, m.end, m.pgoff, want.0, want.1, want.2
        ));
    }
    let id = elf.build_id().ok().flatten().unwrap_or_default();
    if m.build_id.as_bytes() != id {
        return Err(format!(
            "{path}: build id {:02x?} read from guest memory, the file's is {id:02x?}",
            m.build_id.as_bytes()
        ));
    }
    Ok(())
}

/// The kernel's share of a workload's process (its kernel-mode samples among all of its
/// samples) within 2 points of the share native `perf record -e cpu-clock` measured on the host
/// (`truth.json`, `workloads.<w>.kernel_share`, with its command; where perf could not run, a
/// compute-bound workload's 1%), and the hypervisor's share of the whole machine under 2%
/// (natively there is none). At a 4 MHz emulated clock both were dominated by the timer tick:
/// the hypervisor took 38% of the machine.
fn check_native_costs(run: &ProfileRun, workload: &str) -> Result<(), String> {
    let report = linux_report(run)?;
    let rows = rows(&report, "linux")?;
    let mine = |module: &dyn Fn(&str) -> bool| -> f64 {
        process_rows(&rows, workload, module)
            .iter()
            .filter_map(|r| r.get("samples").and_then(Value::as_f64))
            .sum()
    };
    let kernel = mine(&|m| m == "[guest.kallsyms]");
    let all = mine(&|_| true);
    if all < 1000.0 {
        return Err(format!("only {all} samples of {workload}"));
    }
    let native = native_kernel_share(workload).unwrap_or(1.0);
    let guest = 100.0 * kernel / all;
    within(&format!("{workload}'s kernel share"), guest, native, 2.0)?;
    let hypervisor = num(&report, "/host/hypervisor")?;
    if hypervisor > 2.0 {
        return Err(format!(
            "the hypervisor took {hypervisor:.2}% of the machine (natively: none; expected under 2%)"
        ));
    }
    Ok(())
}

/// The kernel's share of `workload` measured natively (`cargo xtask linux-truth`), if perf ran.
fn native_kernel_share(workload: &str) -> Option<f64> {
    let t: Value =
        serde_json::from_slice(&std::fs::read(linux_dir().join("truth.json")).ok()?).ok()?;
    t.pointer(&format!("/workloads/{workload}/kernel_share"))
        .and_then(Value::as_f64)
}

/// The VM `linux`'s profile of `workload`: its process named, its kernel functions named, enough
/// samples; then its user-mode function shares and the ground truth's.
fn workload_shares(run: &ProfileRun, workload: &str) -> Result<(Shares, Shares), String> {
    let report = linux_report(run)?;
    check_named(&report, "linux", workload)?;
    let (shares, samples) = user_shares(&rows(&report, "linux")?, workload, &|m| m == workload);
    if samples < 2000.0 {
        return Err(format!("only {samples} user samples of {workload}"));
    }
    Ok((shares, truth(workload)?))
}

/// (function, percent) pairs.
type Shares = Vec<(String, f64)>;

/// `f`'s share in `list` (0 when absent).
fn share(list: &[(String, f64)], f: &str) -> f64 {
    list.iter().find(|(n, _)| n == f).map_or(0.0, |(_, s)| *s)
}

/// Tables 3-4 with libquantum's `shor`: its top functions in the truth's order, each within 5
/// points.
fn check_shor(run: &ProfileRun) -> Result<(), String> {
    let (shares, truth) = workload_shares(run, "shor")?;
    let top: Vec<&(String, f64)> = truth.iter().filter(|(_, s)| *s >= 5.0).collect();
    let mut errors = Vec::new();
    for (i, (f, want)) in top.iter().enumerate() {
        let got = share(&shares, f);
        if let Err(e) = within(&format!("shor {f}"), got, *want, 5.0) {
            errors.push(e);
        }
        // Same order as the truth (ties within a point may swap).
        if let Some((next, _)) = top.get(i + 1) {
            let after = share(&shares, next);
            if after > got + 1.0 {
                errors.push(format!("{next} ({after:.2}%) ranks above {f} ({got:.2}%)"));
            }
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// The dynamic PIE `shor-dyn` (Debian's stripped libquantum.so.8, libgomp and libc, ASLR on),
/// started by Debian's dynamic busybox, which execs it: named with `--guest-root` only.
/// - Its user-mode function shares, over every file it maps, match callgrind's instruction
///   counts within 5 points for each function of 5% or more (as `bochs-linux-shor`); functions
///   the stripped library has no symbol for are compared by address (callgrind's
///   `0x00000000000043f0` is our `[unknown] libquantum.so.8.0.0+0x43f0`, the function's start).
/// - libc.so.6's functions are named (from its debug file, by build id).
/// - The exec: the process is `busybox` in one address space, then `shor-dyn` in another, with
///   the same tgid; each has its own files, and no sample of one is named from the other's.
/// - The libraries were mapped after the exec: the hypervisor read the map again.
fn check_shared_lib(run: &ProfileRun) -> Result<(), String> {
    let report = run.report_with(None, &root_args())?;
    check_named(&report, "linux", "shor-dyn")?;
    let rows = rows(&report, "linux")?;
    // User mode: every file the process maps, not the kernel.
    let user = |m: &str| m != "[guest.kallsyms]";
    let (shares, total) = user_shares(&rows, "shor-dyn", &user);
    if total < 2000.0 {
        return Err(format!("only {total} user samples of shor-dyn"));
    }
    let mine = process_rows(&rows, "shor-dyn", &user);
    let truth = truth("shor-dyn")?;
    let mut errors = Vec::new();
    for (f, want) in truth.iter().filter(|(_, s)| *s >= 5.0) {
        // callgrind names a function without a symbol by its address in the file.
        let got = match f.strip_prefix("0x") {
            Some(hex) => {
                let addr = u64::from_str_radix(hex, 16).unwrap_or(0);
                let suffix = format!("+{addr:#x}");
                shares
                    .iter()
                    .filter(|(n, _)| n.starts_with("[unknown] libquantum") && n.ends_with(&suffix))
                    .map(|(_, s)| *s)
                    .sum()
            }
            None => share(&shares, f),
        };
        if let Err(e) = within(&format!("shor-dyn {f}"), got, *want, 5.0) {
            errors.push(e);
        }
    }
    let modules: std::collections::BTreeSet<&str> =
        mine.iter().map(|r| str_of(r, "module")).collect();
    // (The program's own code, `main` and little else, takes too few instructions to be sure of
    // a sample.)
    for m in ["libquantum.so.8.0.0", "libc.so.6"] {
        if !modules.contains(m) {
            errors.push(format!("no shor-dyn sample in {m} (modules: {modules:?})"));
        }
    }
    let libc_named = mine
        .iter()
        .filter(|r| str_of(r, "module") == "libc.so.6")
        .filter(|r| !str_of(r, "function").starts_with("[unknown]"))
        .count();
    if libc_named == 0 {
        errors.push("no libc.so.6 function is named".into());
    }
    // The exec: busybox's samples are named from busybox only.
    for r in rows
        .iter()
        .filter(|r| str_of(r, "process").starts_with("busybox["))
    {
        let m = str_of(r, "module");
        if m == "shor-dyn" || m.starts_with("libquantum") {
            errors.push(format!("a busybox sample is named from {m}: {r}"));
        }
    }
    let d = hvprof_samplelog::decode(&run.capture);
    let shor = d
        .tasks
        .iter()
        .find(|t| t.comm.as_str() == "shor-dyn")
        .map(|t| (t.tgid, t.cr3 & !0xfff));
    // Busybox's own address space (before the exec; the exec itself may show the old name in
    // the new space for a moment).
    let busybox = shor.and_then(|(tgid, space)| {
        d.tasks
            .iter()
            .filter(|t| t.comm.as_str() == "busybox" && t.tgid == tgid)
            .map(|t| (t.tgid, t.cr3 & !0xfff))
            .find(|&(_, s)| s != space)
    });
    match (busybox, shor) {
        (Some((_, bs)), Some((s, ss))) => {
            let has = |space: u64, path: &str| {
                d.mappings
                    .iter()
                    .any(|m| m.tgid == s && m.cr3 & !0xfff == space && m.path.as_str() == path)
            };
            if !has(bs, "/usr/bin/busybox") || !has(ss, "/bin/shor-dyn") {
                errors.push(format!(
                    "the exec's two address spaces do not each map their program: {:?}",
                    d.mappings
                        .iter()
                        .filter(|m| m.tgid == s)
                        .map(|m| (m.cr3, m.path.as_str()))
                        .collect::<Vec<_>>()
                ));
            }
        }
        other => errors.push(format!(
            "expected busybox to exec shor-dyn (same tgid, new address space): {other:?}"
        )),
    }
    let text = d.text_joined();
    if !text.contains("hvprof-guest: aslr 2") {
        errors.push("the guest did not report ASLR on (randomize_va_space 2)".into());
    }
    match text
        .lines()
        .find(|l| l.contains("vm linux:") && l.contains("executable mappings of"))
    {
        Some(l) if !l.contains("(0 maps read again") => {}
        other => errors.push(format!(
            "the maps were not read again after the dynamic loader mapped the libraries: {other:?}"
        )),
    }
    all_of(errors.into_iter().map(Err))
}

/// `hashload` hashes through AF_ALG with wp512 from a module loaded with insmod (and unloaded
/// before the end of the run): the kernel's
/// samples in the module are named function by function (`--guest-root` holds the .ko), under
/// `[wp512]`; the functions named are the module's own (the guest's /proc/kallsyms, printed on
/// the console, is the truth), the hashing function first, and the module's range read from
/// guest memory starts at its .text (as /sys/module says).
fn check_module(run: &ProfileRun) -> Result<(), String> {
    let report = run.report_with(None, &root_args())?;
    check_named(&report, "linux", "hashload")?;
    let rows = rows(&report, "linux")?;
    let d = hvprof_samplelog::decode(&run.capture);
    let text = d.text_joined();
    let truth: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            // "ADDR t NAME<TAB>[MODULE]": the console shows the guest's tab as \x09.
            let name = l
                .split_once("hvprof-guest: ksym ")?
                .1
                .split_whitespace()
                .nth(2)?;
            name.split(['\t', '\\']).next()
        })
        .collect();
    if truth.is_empty() {
        return Err("the guest printed no kallsyms lines for its modules".into());
    }
    let mut errors = Vec::new();
    let module: Vec<&Value> = rows
        .iter()
        .filter(|r| str_of(r, "module") == "[wp512]")
        .collect();
    let samples = |list: &[&Value]| -> f64 {
        list.iter()
            .filter_map(|r| r.get("samples").and_then(Value::as_f64))
            .sum()
    };
    let in_module = samples(&module);
    let process = process_rows(&rows, "hashload", &|_| true);
    let all = samples(&process);
    if in_module < 1000.0 || in_module < 0.3 * all {
        errors.push(format!(
            "{in_module} samples in [wp512] of hashload's {all}: expected most of its work"
        ));
    }
    let unnamed: f64 = samples(
        &module
            .iter()
            .copied()
            .filter(|r| str_of(r, "function").starts_with("[unknown]"))
            .collect::<Vec<_>>(),
    );
    if unnamed > 0.01 * in_module {
        errors.push(format!(
            "{unnamed} of {in_module} [wp512] samples not named"
        ));
    }
    for r in &module {
        let f = str_of(r, "function");
        if !f.starts_with("[unknown]") && !truth.contains(&f) {
            errors.push(format!(
                "[wp512] function {f} is not in the guest's kallsyms"
            ));
        }
    }
    if module.first().map(|r| str_of(r, "function")) != Some("wp512_process_buffer") {
        errors.push(format!(
            "the top [wp512] function is {:?}, expected wp512_process_buffer",
            module.first().map(|r| str_of(r, "function"))
        ));
    }
    let text_at = text
        .lines()
        .find_map(|l| {
            l.split_once("hvprof-guest: module wp512 .text ")?
                .1
                .split_whitespace()
                .next()
        })
        .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
    let frame = d
        .mappings
        .iter()
        .find(|m| m.kind == hvprof_samplelog::MappingKind::Module && m.path.as_str() == "wp512");
    match (text_at, frame) {
        (Some(t), Some(m)) if m.start == t => {}
        (t, m) => errors.push(format!(
            "module wp512: .text at {t:x?} in the guest, mapping frame {:x?}",
            m.map(|m| (m.start, m.end))
        )),
    }
    all_of(errors.into_iter().map(Err))
}

/// Two Linux guests on one pCPU: each shows steal, and the host-level rows split between them.
fn check_two(run: &ProfileRun) -> Result<(), String> {
    let report = linux_report(run)?;
    let total = num(&report, "/total_samples")?;
    let host = report
        .pointer("/host/rows")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut errors = Vec::new();
    for name in ["linux1", "linux2"] {
        if let Err(e) = check_named(&report, name, "w41") {
            errors.push(format!("{name}: {e}"));
        }
        let steal = num(vm(&report, name)?, "/steal")?;
        if steal < 20.0 {
            errors.push(format!("{name}: steal {steal:.1}%, expected well above 0"));
        }
        let row = host
            .iter()
            .find(|r| str_of(r, "function") == format!("[{name}]"))
            .and_then(|r| r.get("samples").and_then(Value::as_f64))
            .unwrap_or(0.0);
        if 100.0 * row / total < 20.0 {
            errors.push(format!(
                "{name}: host-level row {:.1}%, expected a share of the pCPU",
                100.0 * row / total
            ));
        }
    }
    all_of(errors.into_iter().map(Err))
}

/// `bochs-linux-stacks`: in w41-fp's call graph, `main` calls `work_a` on 80 % of the samples it
/// calls into `work_a` or `work_b` (± 3 points), as w41's 4:1 work says. Then zeroread's kernel
/// chains, unwound by the kernel's ORC tables: the samples in `read_zero` (the /dev/zero read,
/// where the kernel clears the user's buffer) go up through the system call's whole path and on
/// into the user's callers, each edge in at least 95 % of them.
fn check_linux_stacks(run: &ProfileRun) -> Result<(), String> {
    let mut args = root_args();
    args.push("--call-graph".into());
    let report = run.report_with(None, &args)?;
    let edge = |caller, callee| crate::stack_scenarios::edge(&report, "linux", caller, callee);
    let (a, b) = (edge("main", "work_a"), edge("main", "work_b"));
    if a + b < 3000.0 {
        return Err(format!(
            "main -> work_a {a} and main -> work_b {b} samples: expected thousands (w41-fp's user samples with their callers)"
        ));
    }
    within(
        "main -> work_a share of main's calls into work_a and work_b",
        100.0 * a / (a + b),
        80.0,
        3.0,
    )?;
    let base = edge("vfs_read", "read_zero");
    if base < 2000.0 {
        return Err(format!(
            "vfs_read -> read_zero in {base} samples: expected thousands (zeroread's kernel samples with their callers)"
        ));
    }
    // Innermost first; `__read` is glibc's wrapper, which keeps no frame record, so its caller
    // `read_chunk` is skipped (the frame-pointer walk goes from it to `read_rounds`).
    let path = [
        ("ksys_read", "vfs_read"),
        ("do_syscall_64", "ksys_read"),
        ("entry_SYSCALL_64_after_hwframe", "do_syscall_64"),
        ("__read", "entry_SYSCALL_64_after_hwframe"),
        ("read_rounds", "__read"),
        ("main", "read_rounds"),
    ];
    let short: Vec<String> = path
        .iter()
        .map(|&(caller, callee)| (caller, callee, edge(caller, callee)))
        .filter(|&(.., n)| n < 0.95 * base)
        .map(|(caller, callee, n)| format!("{caller} -> {callee} in {n} samples"))
        .collect();
    if !short.is_empty() {
        return Err(format!(
            "zeroread's kernel chains: {} of the {base} samples of vfs_read -> read_zero (expected at least 95 %)",
            short.join(", ")
        ));
    }
    check_shor_chains(&report)
}

/// shor's chains through libquantum and libgomp, built without frame pointers and unwound by
/// the unwind table the host made from shor's `.eh_frame` (`unwind=`). libquantum's gates run
/// their loops in OpenMP-outlined functions that `GOMP_parallel` calls: the samples in
/// `quantum_toffoli._omp_fn.0` must run through `GOMP_parallel` and `quantum_toffoli` into a
/// function whose machine code calls `quantum_toffoli` (the binary's own call sites, found by
/// `objdump`; where functions end in tail calls to it, their callers) and on to
/// `main`, each step in at least 95 % of them; no sample may name any other caller of
/// `quantum_toffoli` in more than 1 % of them.
fn check_shor_chains(report: &Value) -> Result<(), String> {
    let edge =
        |caller: &str, callee: &str| crate::stack_scenarios::edge(report, "linux", caller, callee);
    let leaf = "quantum_toffoli._omp_fn.0";
    let base = edge("GOMP_parallel", leaf);
    let own = rows(report, "linux")?
        .iter()
        .filter(|r| str_of(r, "function") == leaf && str_of(r, "process").starts_with("shor["))
        .filter_map(|r| r.get("samples").and_then(Value::as_f64))
        .sum::<f64>();
    if own < 1000.0 {
        return Err(format!(
            "{leaf}: {own} samples in shor, expected thousands (shor 21,2,1 spends ~43 % there)"
        ));
    }
    let mut errors = Vec::new();
    if base < 0.95 * own {
        errors.push(format!(
            "GOMP_parallel -> {leaf} in {base} of its {own} samples (expected at least 95 %: the FP-less leaf's caller comes from the unwind table)"
        ));
    }
    let toffoli = edge("quantum_toffoli", "GOMP_parallel");
    if toffoli < 0.95 * base {
        errors.push(format!(
            "quantum_toffoli -> GOMP_parallel in {toffoli} samples, expected at least 95 % of {base}"
        ));
    }
    let allowed = callers_in_binary(&linux_dir().join("bin/shor"), "quantum_toffoli")?;
    let callers: Vec<(String, f64)> = report
        .pointer("/call_graph/edges")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|e| {
            e.get("level").and_then(Value::as_str) == Some("linux")
                && e.get("callee").and_then(Value::as_str) == Some("quantum_toffoli")
        })
        .map(|e| {
            (
                e.get("caller")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                e.get("samples").and_then(Value::as_f64).unwrap_or(0.0),
            )
        })
        .collect();
    let good: f64 = callers
        .iter()
        .filter(|(c, _)| allowed.contains(c))
        .map(|(_, n)| n)
        .sum();
    if good < 0.95 * base {
        errors.push(format!(
            "quantum_toffoli's callers from its call sites ({allowed:?}) in {good} samples, expected at least 95 % of {base}; all its callers: {callers:?}"
        ));
    }
    for (c, n) in &callers {
        if !allowed.contains(c) && *n > 0.01 * base {
            errors.push(format!(
                "{c} -> quantum_toffoli in {n} samples: {c} has no call to it"
            ));
        }
    }
    let main = edge("main", "quantum_exp_mod_n");
    if main < 0.95 * base {
        errors.push(format!(
            "main -> quantum_exp_mod_n in {main} samples, expected at least 95 % of {base} (chains through libquantum up to main)"
        ));
    }
    all_of(errors.into_iter().map(Err))
}

/// The functions of `program` that call `target`, by `objdump -d`: those with a `call` to it,
/// and the callers of those that end in a jump to it, or to such a function (a tail call
/// returns to the caller's caller).
fn callers_in_binary(
    program: &std::path::Path,
    target: &str,
) -> Result<std::collections::BTreeSet<String>, String> {
    let out = std::process::Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(program)
        .output()
        .map_err(|e| format!("objdump (binutils) on {}: {e}", program.display()))?;
    if !out.status.success() {
        return Err(format!("objdump on {} failed", program.display()));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // (function, instruction, callee) for every direct call and jump.
    let mut sites: Vec<(String, bool, String)> = Vec::new();
    let mut function = String::new();
    for line in text.lines() {
        if let Some(name) = line
            .strip_suffix(">:")
            .and_then(|l| l.split_once(" <"))
            .map(|(_, n)| n)
        {
            function = name.to_owned();
            continue;
        }
        let mut words = line.split_whitespace().skip(1);
        let (Some(op), Some(_), Some(dest)) = (words.next(), words.next(), words.next()) else {
            continue;
        };
        let call = op == "call";
        if !(call || op == "jmp") {
            continue;
        }
        if let Some(callee) = dest.strip_prefix('<').and_then(|d| d.strip_suffix('>'))
            && !callee.contains('+')
        {
            sites.push((function.clone(), call, callee.to_owned()));
        }
    }
    let direct = |t: &str, call: bool| -> std::collections::BTreeSet<String> {
        sites
            .iter()
            .filter(|(_, c, callee)| *c == call && callee == t)
            .map(|(f, ..)| f.clone())
            .collect()
    };
    // The functions whose last act is to jump to the target, or to such a function (mul_mod_n
    // jumps to muln_inv, which jumps to quantum_toffoli): their callers are the target's.
    let mut tails = std::collections::BTreeSet::from([target.to_owned()]);
    loop {
        let more: Vec<String> = tails
            .iter()
            .flat_map(|t| direct(t, false))
            .filter(|f| !tails.contains(f))
            .collect();
        if more.is_empty() {
            break;
        }
        tails.extend(more);
    }
    let all: std::collections::BTreeSet<String> =
        tails.iter().flat_map(|t| direct(t, true)).collect();
    if all.is_empty() {
        return Err(format!(
            "objdump: no call to {target} in {}",
            program.display()
        ));
    }
    Ok(all)
}

/// The machine every Linux scenario runs on: Bochs at a realistic 1 GHz clock, so that the
/// guest's timer tick and delays cost what they cost on hardware; the sample log goes to the
/// parallel port (the UART would take 87,000 instructions per byte at this clock).
pub fn linux_machine(name: &str) -> Scenario {
    Scenario::new(
        name,
        Emulator::bochs(HASWELL).with_ips(crate::emulator::BOCHS_IPS_REALISTIC),
    )
}

/// The sampling period of the Linux scenarios, in TSC ticks (= instructions in Bochs): 8,000
/// instructions (8 µs at 1 GHz) gives 10,000 samples of w41's 80 M instructions. A real machine
/// would sample every millisecond over a longer run; an emulator affords ~1 G instructions.
pub const LINUX_PERIOD: &str = "period=8000ticks";

/// The Linux scenarios.
pub fn all() -> Vec<Scenario> {
    let boot = |name: &str| {
        linux_machine(name)
            .cmdline(&format!("export=end channel=lpt {LINUX_PERIOD}"))
            .budget(Duration::from_secs(240))
    };
    vec![
        // Call chains in a Linux guest: w41 built with frame pointers (its user-mode samples
        // carry their callers), then zeroread's system calls (kernel chains by the kernel's ORC
        // tables, `orc-layout=`, on into the user's frame pointers), then shor, whose
        // libquantum and libgomp keep no frame pointers (chains by the unwind table of shor's
        // `.eh_frame`, `unwind=`).
        linux_vm_with(
            linux_machine("bochs-linux-stacks")
                .cmdline(&format!("export=end channel=lpt {LINUX_PERIOD} stacks=16"))
                .budget(Duration::from_secs(300)),
            "linux",
            "w41-fp",
            "400",
            "hvprof.then=zeroread hvprof.thenarg=500 hvprof.then2=shor hvprof.then2arg=21,2,1 unwind=shor.unwind",
        )
        .module(
            "shor.unwind",
            ModuleSource::UnwindTable(linux_dir().join("bin/shor")),
            "",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .profile(check_linux_stacks),
        // The same guest on one pCPU: w41 keeps one vCPU busy, the other halts: its blank time
        // is idle, not steal, and the busy one loses little to it (the paper's Tables 14/15).
        // Then every CPU is asked for its backtrace: the other, halted, gets an NMI IPI.
        linux_apic_module(
            boot("bochs-linux-smp-halt"),
            "0,0",
            "hvprof.run=w41 hvprof.arg=400 hvprof.backtrace=1 hvprof.hotplug=1",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .check(check_nmi_backtrace)
        .check(check_hotplug)
        .profile(check_smp_halt),
        linux_vm(boot("bochs-linux-w41"), "linux", "w41", "400")
            .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
            // The image loads no module: the list, found at `modules` moved by the KASLR slide,
            // is read whole and empty.
            .check(|log| {
                log.expect("vm linux: 0 kernel modules read from guest memory")
                    .and_then(|l| {
                        if l.contains("could not be read whole") {
                            Err(format!("the module list was not read whole: {l}"))
                        } else {
                            Ok(())
                        }
                    })
            })
            .profile(check_w41),
        linux_vm(boot("bochs-linux-shor"), "linux", "shor", "35,2,1")
            .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
            .profile(check_shor),
        linux_vm_with(
            boot("bochs-linux-shared-lib"),
            "linux",
            "shor-dyn",
            "35,2,1",
            "hvprof.via=busybox",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        .profile(check_shared_lib),
        linux_vm_with(
            // It loads three kernel modules and hashes with them: the longest Linux scenario
            // (200 s here at calibration x1.03, against w41's 67 s).
            boot("bochs-linux-module").budget(Duration::from_secs(360)),
            "linux",
            "hashload",
            "1024",
            "hvprof.modules=af_alg,algif_hash,wp512 hvprof.rmmod=1",
        )
        .check(|log| check_exit_code(log, "linux", 0, "port 0xf4"))
        // The modules are unloaded before the run ends: only the list read during the run (at
        // the first sample in wp512) names them.
        // (A kernel message: the guest's console line is `[linux] [<time>] hvprof-guest: ...`.)
        .check(|log| {
            log.expect_containing("[linux] ", "] hvprof-guest: unloaded af_alg")
                .map(|_| ())
        })
        .check(|log| {
            let l = log.expect("vm linux: 3 kernel modules read from guest memory (")?;
            match l
                .split_once('(')
                .and_then(|(_, r)| r.split_whitespace().next()?.parse::<u32>().ok())
            {
                Some(n) if n >= 1 => Ok(()),
                _ => Err(format!("the module list was not read during the run: {l}")),
            }
        })
        .profile(check_module),
        // Two kernels boot: 2 ms samples, and room for all of them in memory. The second traps
        // and emulates every local APIC access, as on a CPU without APIC virtualization.
        linux_vm_emulated_apic(
            linux_vm(boot("bochs-linux-two-guests"), "linux1", "w41", "200"),
            "linux2",
            "w41",
            "200",
        )
        .budget(Duration::from_secs(360))
        .check(|log| {
            check_exit_code(log, "linux1", 0, "port 0xf4")?;
            check_exit_code(log, "linux2", 0, "port 0xf4")?;
            check_apic_virtualization(log, "linux1", true)?;
            check_apic_virtualization(log, "linux2", false)
        })
        .profile(check_two),
    ]
}
