//! `perf script` text: one event per sample, blank-line separated, stacks leaf first, in the
//! layout `perf script` prints by default, so that the tools that read it take it as it is
//! (FlameGraph's `stackcollapse-perf.pl`, inferno's `collapse-perf`, speedscope, the Firefox
//! Profiler):
//!
//! ```text
//! guestOS1 100000/100001 [000] 1.234567: cpu-clock:
//! →          200130 work_a ([guest.kallsyms:mix1.elf])
//! →               0 cr3:0x3000 (guest.process)
//!
//! [hypervisor] 1/10 [000] 1.235567: cpu-clock:
//! →         1012345 hvprof::vm::run::run_slice ([hvprof])
//! →               0 guestOS1: PREEMPTION_TIMER ([hvprof])
//! ```
//!
//! (→ is a tab.)
//!
//! - comm: the VM's name (spaces made `_`), `[hypervisor]`, or `[idle]`;
//! - pid/tid: a VM is a process and each of its vCPUs a thread (pid 100000 + 1000 × VM,
//!   tid pid + 1 + vCPU); the hypervisor is pid 1 with one thread per pCPU (tid 10 + pCPU); idle is
//!   0/0, like perf's `swapper`. Every tid is unique (the Firefox Profiler keys threads by tid),
//!   none is negative;
//! - the time is the TSC in seconds; the event is `cpu-clock` (deadline clock) or `ref-cycles`
//!   (PMU), and no period is printed: each event is one sample;
//! - frames: the function, then the guest process (`cr3:0x...` or `comm[tgid]`, module
//!   `guest.process`) or, for the hypervisor, whom it worked for and on which exit. Guest kernel
//!   code (CPL 0) is under a module that viewers mark as kernel: its name starts with `[` and holds
//!   `kallsyms` (`[guest.kallsyms]` for Linux, `[guest.kallsyms:<image>]` for other guests).

use std::io::{self, Write};

use crate::profile::{Frame, Profile, What};
use crate::progress::Progress;

/// The module of the guest-process frames.
pub const PROCESS_MODULE: &str = "guest.process";
/// The module of the hypervisor's frames.
pub const HYPERVISOR_MODULE: &str = "[hvprof]";

/// pid and tid of a sample's thread.
pub fn ids(what: What, vm: u16, vcpu: u16, pcpu: u16) -> (u32, u32) {
    match what {
        What::Idle => (0, 0),
        What::Hypervisor => (1, 10 + u32::from(pcpu)),
        What::GuestKernel | What::GuestUser => {
            let pid = 100_000 + 1000 * u32::from(vm);
            (pid, pid + 1 + u32::from(vcpu.min(998)))
        }
    }
}

/// A comm for `perf script`: no whitespace, and never a number alone (readers take the first
/// all-digit word as the pid).
pub fn comm(name: &str) -> String {
    let c: String = name
        .chars()
        .map(|c| if c.is_whitespace() { '_' } else { c })
        .collect();
    if c.is_empty() || c.chars().all(|c| c.is_ascii_digit()) {
        format!("vm_{c}")
    } else {
        c
    }
}

/// The module a frame's function is written under.
pub fn script_module(f: &Frame) -> String {
    let m = match f.what {
        What::Hypervisor | What::Idle => HYPERVISOR_MODULE.to_owned(),
        What::GuestKernel if !f.module.contains("kallsyms") => format!(
            "[guest.kallsyms:{}]",
            if f.module.is_empty() { "?" } else { &f.module }
        ),
        _ if f.module.is_empty() => "[unknown]".to_owned(),
        _ => f.module.clone(),
    };
    m.replace(char::is_whitespace, "_")
}

/// A frame name on a stack line: no newline; a leading `(` would make readers skip it.
fn frame_name(s: &str) -> String {
    let s = s.replace(['\n', '\r'], " ");
    if s.starts_with('(') {
        format!("[{s}]")
    } else {
        s
    }
}

/// Writes every sample of `p` as `perf script` text.
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> io::Result<()> {
    let event = if p.report.source == "pmu" {
        "ref-cycles"
    } else {
        "cpu-clock"
    };
    // Per frame: " function (module)\n" for the leaf, and the outer frames' lines.
    let tails: Vec<(String, String)> = p
        .frames
        .iter()
        .map(|f| {
            let leaf = format!(" {} ({})\n", frame_name(&f.function), script_module(f));
            let outer = match f.what {
                What::GuestKernel | What::GuestUser => format!(
                    "\t{:>16x} {} ({PROCESS_MODULE})\n",
                    0,
                    frame_name(&f.process)
                ),
                What::Hypervisor => format!(
                    "\t{:>16x} {} ({HYPERVISOR_MODULE})\n",
                    0,
                    frame_name(&f.process)
                ),
                What::Idle => String::new(),
            };
            (leaf, outer)
        })
        .collect();
    let mut comms: Vec<String> = Vec::new();
    let vm_comm = |vm: u16| comm(&p.vm_name(vm));
    let hz = if p.tsc_hz == 0 { 1e9 } else { p.tsc_hz as f64 };
    progress.phase("perf script", Some(p.samples.len() as u64), "samples");
    for (i, s) in p.samples.iter().enumerate() {
        let (pid, tid) = ids(s.what, s.vm, s.vcpu, s.pcpu);
        let c: &str = match s.what {
            What::Idle => "[idle]",
            What::Hypervisor => "[hypervisor]",
            What::GuestKernel | What::GuestUser => {
                let k = usize::from(s.vm);
                if comms.len() <= k {
                    comms.resize(k + 1, String::new());
                }
                if comms[k].is_empty() {
                    comms[k] = vm_comm(s.vm);
                }
                &comms[k]
            }
        };
        let (leaf, outer) = &tails[s.frame as usize];
        write!(
            out,
            "{c} {pid}/{tid} [{:03}] {:.6}: {event}:\n\t{:>16x}{leaf}{outer}\n",
            s.pcpu,
            s.tsc as f64 / hz,
            s.addr
        )?;
        if i % 65536 == 65535 {
            progress.inc(65536);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_never_negative() {
        let mut seen = std::collections::HashMap::new();
        for vm in 0..64u16 {
            for vcpu in 0..8u16 {
                let (pid, tid) = ids(What::GuestUser, vm, vcpu, 0);
                assert_eq!(ids(What::GuestKernel, vm, vcpu, 3), (pid, tid));
                assert!(seen.insert(tid, (vm, vcpu)).is_none());
                assert_ne!(pid, tid);
            }
        }
        for pcpu in 0..256u16 {
            let (pid, tid) = ids(What::Hypervisor, 0, 0, pcpu);
            assert_eq!(pid, 1);
            assert!(seen.insert(tid, (0xffff, pcpu)).is_none());
        }
        assert!(!seen.contains_key(&0), "tid 0 is idle's");
    }

    #[test]
    fn comms_parse_as_one_word() {
        assert_eq!(comm("guest OS 1"), "guest_OS_1");
        assert_eq!(comm("42"), "vm_42");
        assert_eq!(comm(""), "vm_");
    }

    #[test]
    fn kernel_frames_are_marked_kernel() {
        let f = Frame {
            what: What::GuestKernel,
            vm: "a".into(),
            process: "cr3:0x1000".into(),
            module: "mix1.elf".into(),
            function: "work_a".into(),
            process_key: None,
        };
        let m = script_module(&f);
        assert!(m.starts_with('[') && m.contains("kallsyms"), "{m}");
        let linux = Frame {
            module: "[guest.kallsyms]".into(),
            ..f.clone()
        };
        assert_eq!(script_module(&linux), "[guest.kallsyms]");
        let user = Frame {
            what: What::GuestUser,
            module: "w41".into(),
            ..f
        };
        assert_eq!(script_module(&user), "w41");
    }
}
