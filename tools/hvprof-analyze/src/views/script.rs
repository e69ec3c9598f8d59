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
//!
//! A sample with call chains has its callers between its function and the outer frames, one
//! line each, as `perf script` prints a callchain: `→<address> <function>+0x<offset> (<module>)`
//! (the offset where the symbols give the function's start), innermost first, then a cut
//! chain's `[truncated: depth limit]` or `[truncated: bad frame]`. A hypervisor sample on a
//! vCPU's exit with its guest chain (its exit cause) is an event of that vCPU's thread (comm:
//! the VM): its function and the hypervisor's frames, `[exit: REASON]`, then the guest's frames
//! from the exit's RIP out. Folded, every sample is the stack the flame graph draws.

use std::io::{self, Write};

use rustc_hash::FxHashMap as HashMap;
use strength_reduce::StrengthReducedU64;

use crate::model::profile::Profile;
use crate::model::progress::Progress;
use crate::model::samples::{Frame, Stack, What};
use crate::model::stack_table::prefetch;
use crate::model::whole_stack::{Part, whole_stack};

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

/// A chain frame's line: `\t<address> <function>+0x<offset> (<module>)`.
fn site_line(p: &Profile, site: u32) -> String {
    let cs = &p.calls.sites[site as usize];
    let f = &p.calls.frames[cs.frame as usize];
    let module = script_module(&Frame {
        what: f.what,
        vm: String::new(),
        process: String::new(),
        module: f.module.clone(),
        function: f.function.clone(),
        process_key: None,
    });
    let name = frame_name(&f.function);
    match cs.offset {
        Some(off) => format!("\t{:>16x} {name}+{off:#x} ({module})\n", cs.addr),
        None => format!("\t{:>16x} {name} ({module})\n", cs.addr),
    }
}

/// The lines after a chained stack's first (its function's), as indexes into `lines`: its
/// frames innermost first, with the outer frame of whom it ran for (`outer`) where the flame
/// graph has it.
fn chain_lines(
    p: &Profile,
    s: &Stack,
    outer: &str,
    lines: &mut Vec<String>,
    index: &mut HashMap<String, u32>,
    out: &mut Vec<u32>,
) {
    let mut special = |text: String, lines: &mut Vec<String>| -> u32 {
        *index.entry(text.clone()).or_insert_with(|| {
            lines.push(text);
            (lines.len() - 1) as u32
        })
    };
    let parts = whole_stack(p, s).unwrap_or_default();
    let mut host = true;
    for part in parts.iter().rev() {
        match part {
            Part::Root(_) | Part::Leaf(_) => {}
            Part::Process(_) => {
                if !outer.is_empty() {
                    out.push(special(outer.to_owned(), lines));
                }
            }
            Part::Site(i) => {
                host = p.calls.frame(*i).what == What::Hypervisor;
                out.push(*i);
            }
            Part::Exit(r) => {
                host = false;
                out.push(special(
                    format!(
                        "\t{:>16x} {} ({HYPERVISOR_MODULE})\n",
                        0,
                        crate::model::calls::exit_frame_name(*r)
                    ),
                    lines,
                ));
            }
            Part::Truncated(end) => {
                let module = if host && s.what != What::GuestKernel && s.what != What::GuestUser {
                    HYPERVISOR_MODULE
                } else {
                    "[unknown]"
                };
                out.push(special(
                    format!(
                        "\t{:>16x} {} ({module})\n",
                        0,
                        crate::model::calls::truncated_name(*end).unwrap_or("[truncated]")
                    ),
                    lines,
                ));
            }
        }
    }
}

/// Where a frame's texts are in the arena of [`write`]: its leaf at `a..m`, its outer lines at
/// `m..e`, for `(a, m, e)`.
type Span = (usize, usize, usize);

/// Writes every sample of `p` as `perf script` text.
pub fn write(p: &Profile, out: &mut dyn Write, progress: &Progress) -> io::Result<()> {
    let event = if p.source == "pmu" {
        "ref-cycles"
    } else {
        "cpu-clock"
    };
    progress.phase("frame lines", None, "frames");
    // The frames' texts in one arena, frame f's leaf (" function (module)\n") at `arena[a..m]`
    // and its outer frames' lines at `arena[m..e]` for `spans[f] = (a, m, e)`: the loop below
    // reads them at random, and prefetches them a few samples ahead. Hundreds of thousands of
    // frames: each core writes a share into an arena of its own, and the shares are joined.
    let shares: Vec<(Vec<u8>, Vec<Span>)> =
        crate::model::par::par_map(p.frames.chunks(4096).collect(), |c| {
            let mut arena: Vec<u8> = Vec::with_capacity(c.len() * 96);
            let spans = c
                .iter()
                .map(|f| {
                    let a = arena.len();
                    // Into a vector: cannot fail.
                    let _ = writeln!(arena, " {} ({})", frame_name(&f.function), script_module(f));
                    let m = arena.len();
                    let _ = match f.what {
                        What::GuestKernel | What::GuestUser => writeln!(
                            arena,
                            "\t{:>16x} {} ({PROCESS_MODULE})",
                            0,
                            frame_name(&f.process)
                        ),
                        What::Hypervisor => writeln!(
                            arena,
                            "\t{:>16x} {} ({HYPERVISOR_MODULE})",
                            0,
                            frame_name(&f.process)
                        ),
                        What::Idle => Ok(()),
                    };
                    (a, m, arena.len())
                })
                .collect();
            (arena, spans)
        });
    let mut arena: Vec<u8> = Vec::with_capacity(shares.iter().map(|(a, _)| a.len()).sum());
    let mut spans: Vec<Span> = Vec::with_capacity(p.frames.len());
    for (share, share_spans) in shares {
        let base = arena.len();
        arena.extend_from_slice(&share);
        spans.extend(
            share_spans
                .into_iter()
                .map(|(a, m, e)| (base + a, base + m, base + e)),
        );
    }
    // Per stack, what its lines need (the replay gives each sample's time and stack only): its
    // line's start (comm, pid/tid, pCPU; one of a few, in `starts`), its frame, its address.
    let mut starts: Vec<String> = Vec::new();
    let mut start_of: HashMap<(What, u16, u16, u16), u32> = HashMap::default();
    let line_of: Vec<(u32, u32, u64)> = p
        .samples
        .stacks()
        .iter()
        .map(|s| {
            // An exit cause is its vCPU's.
            let thread = if s.exit_cause && s.calls != 0 {
                What::GuestUser
            } else {
                s.what
            };
            let (vm, vcpu) = match thread {
                What::Idle => (0, 0),
                What::Hypervisor => (0, 0),
                What::GuestKernel | What::GuestUser => (s.vm, s.vcpu),
            };
            let what = if thread == What::GuestKernel {
                What::GuestUser
            } else {
                thread
            };
            let start = *start_of.entry((what, vm, vcpu, s.pcpu)).or_insert_with(|| {
                let (pid, tid) = ids(thread, s.vm, s.vcpu, s.pcpu);
                let c = match thread {
                    What::Idle => "[idle]".to_owned(),
                    What::Hypervisor => "[hypervisor]".to_owned(),
                    What::GuestKernel | What::GuestUser => comm(&p.vm_name(s.vm)),
                };
                starts.push(format!("{c} {pid}/{tid} [{:03}] ", s.pcpu));
                (starts.len() - 1) as u32
            });
            (start, s.frame, s.addr)
        })
        .collect();
    // Chained stacks: their lines after the first, as indexes into `lines` (the chains' frames
    // first, then the outer and special frames), each stack's in `chained[from..to]`.
    let mut lines: Vec<String> = (0..p.calls.sites.len() as u32)
        .map(|i| site_line(p, i))
        .collect();
    let mut special: HashMap<String, u32> = HashMap::default();
    let mut chained: Vec<u32> = Vec::new();
    let chain_of: Vec<(u32, u32)> = p
        .samples
        .stacks()
        .iter()
        .map(|s| {
            if s.calls == 0 {
                return (0, 0);
            }
            let from = chained.len() as u32;
            let (_, m, e) = spans[s.frame as usize];
            // Made of strings and ASCII, cut where each was written.
            let outer = std::str::from_utf8(&arena[m..e]).unwrap_or_default();
            chain_lines(p, s, outer, &mut lines, &mut special, &mut chained);
            (from, chained.len() as u32)
        })
        .collect();
    let middle = format!(": {event}:\n\t");
    let chains = p.samples.has_chains();
    let hz = StrengthReducedU64::new(if p.tsc_hz == 0 {
        1_000_000_000
    } else {
        p.tsc_hz
    });
    progress.phase("perf script", Some(p.samples.len() as u64), "samples");
    p.replay_stacks(
        |run, (text, n): &mut (Vec<u8>, u64)| {
            text.clear();
            *n = run.len() as u64;
            for (i, &(tsc, stack)) in run.iter().enumerate() {
                // Three random reads a sample, each prefetched once the one before it is in.
                if let Some(&(_, next)) = run.get(i + 16) {
                    prefetch(&line_of[next as usize]);
                }
                if let Some(&(_, next)) = run.get(i + 8) {
                    prefetch(&spans[line_of[next as usize].1 as usize]);
                }
                if let Some(&(_, next)) = run.get(i + 4) {
                    let (a, _, e) = spans[line_of[next as usize].1 as usize];
                    prefetch(&arena[a..e]);
                }
                let stack = stack as usize;
                let (start, frame, addr) = line_of[stack];
                text.extend_from_slice(starts[start as usize].as_bytes());
                seconds(text, tsc, hz);
                text.extend_from_slice(middle.as_bytes());
                hex16(text, addr);
                let (a, m, e) = spans[frame as usize];
                let (from, to) = if chains { chain_of[stack] } else { (0, 0) };
                if from == to {
                    // The leaf and the outer lines are next to each other.
                    text.extend_from_slice(&arena[a..e]);
                } else {
                    text.extend_from_slice(&arena[a..m]);
                    for &l in &chained[from as usize..to as usize] {
                        text.extend_from_slice(lines[l as usize].as_bytes());
                    }
                }
                text.push(b'\n');
            }
        },
        |(text, n)| {
            out.write_all(text)?;
            progress.inc(*n);
            Ok(())
        },
    )
    // An error of the output keeps its kind (a closed pipe is how `| head` ends the run).
    .map_err(|e| e.downcast::<io::Error>().unwrap_or_else(io::Error::other))
}

/// `tsc / hz` seconds with six decimals, rounded to the nearest microsecond (`hz` is not 0;
/// the divisions by it are multiplications, `strength_reduce`: a call per sample).
fn seconds(out: &mut Vec<u8>, tsc: u64, reduced: StrengthReducedU64) {
    let hz = reduced.get();
    let mut buf = itoa::Buffer::new();
    // In 64-bit divisions when the microseconds fit: tsc = q hz + r, so
    // (tsc 10^6 + hz / 2) / hz = q 10^6 + (r 10^6 + hz / 2) / hz, whose last term's dividend
    // is below (10^6 + 1) hz.
    let (q, r) = StrengthReducedU64::div_rem(tsc, reduced);
    let fast = hz
        .checked_mul(1_000_001)
        .and_then(|_| q.checked_mul(1_000_000))
        .and_then(|whole| whole.checked_add((r * 1_000_000 + hz / 2) / reduced));
    let frac = match fast {
        Some(us) => {
            out.extend_from_slice(buf.format(us / 1_000_000).as_bytes());
            (us % 1_000_000) as u32
        }
        None => {
            let us = (u128::from(tsc) * 1_000_000 + u128::from(hz / 2)) / u128::from(hz);
            out.extend_from_slice(buf.format(us / 1_000_000).as_bytes());
            (us % 1_000_000) as u32
        }
    };
    out.push(b'.');
    let mut digits = [b'0'; 6];
    let mut f = frac;
    for d in digits.iter_mut().rev() {
        *d = b'0' + (f % 10) as u8;
        f /= 10;
    }
    out.extend_from_slice(&digits);
}

/// `v` in lower-case hex, right-aligned in 16 columns (`{:>16x}`).
fn hex16(out: &mut Vec<u8>, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [b' '; 16];
    let mut x = v;
    let mut i = 16;
    loop {
        i -= 1;
        buf[i] = HEX[(x & 0xf) as usize];
        x >>= 4;
        if x == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf);
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
    fn times_and_addresses_print_as_perf_script_does() {
        for (tsc, hz, want) in [
            (0u64, 1_000_000_000u64, "0.000000"),
            (1_234_567_890, 1_000_000_000, "1.234568"),
            (999_999_500, 1_000_000_000, "1.000000"),
            (u64::MAX, 1, "18446744073709551615.000000"),
            (2_400_000, 2_400_000_000, "0.001000"),
            // Past 64-bit microseconds (the 128-bit path), and just below.
            (u64::MAX, 1000, "18446744073709551.615000"),
            (u64::MAX, 2_400_000_000, "7686143364.045647"),
            (1_200_000_001, 2_400_000_000, "0.500000"),
            (1_199_997_599, 2_400_000_000, "0.499999"),
            (1_199_998_800, 2_400_000_000, "0.500000"),
        ] {
            let mut out = Vec::new();
            seconds(&mut out, tsc, StrengthReducedU64::new(hz));
            assert_eq!(String::from_utf8(out).unwrap(), want, "{tsc} / {hz}");
        }
        for v in [0u64, 1, 0xabc, 0xffff_8000_0020_7bfb, u64::MAX] {
            let mut out = Vec::new();
            hex16(&mut out, v);
            assert_eq!(String::from_utf8(out).unwrap(), format!("{v:>16x}"));
        }
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
