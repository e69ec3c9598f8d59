//! End-to-end scenarios of call chains (`stacks=`): a guest whose call tree is known by
//! construction (`guests/src/bin/stacks.rs`), and a guest that forges hostile frame chains
//! (`guests/src/bin/stackattack.rs`). The captures are checked twice: decoded here and
//! symbolized with the guest's own ELF symbol table (so the hypervisor's walks are judged without
//! the analyzer), and through `hvprof-analyze report --json --call-graph` (what users see).

use crate::emulator::Emulator;
use crate::log::SerialLog;
use crate::profile::{ProfileRun, within};
use crate::profile_scenarios::TOLERANCE;
use crate::runner::{ModuleSource, Scenario};
use crate::scenarios::HASWELL;
use crate::vm_scenarios::{all_of, check_exit_code};
use hvprof_samplelog::{ChainEnd, Decoded, Sample, SampleKind};
use object::{Object, ObjectSymbol, SymbolKind};
use serde_json::Value;

/// The recursion depth the known-tree scenario asks for.
const DEPTH: usize = 4;
/// The basic exit reason of CPUID (SDM Vol. 3D, Appendix C).
const EXIT_CPUID: u16 = 10;

/// A guest ELF's functions: (start, end, name), sorted.
struct Symbols(Vec<(u64, u64, String)>);

impl Symbols {
    fn read(path: &std::path::Path) -> Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let file = object::File::parse(&*bytes)
            .map_err(|e| format!("{} is not an ELF file: {e}", path.display()))?;
        let mut v: Vec<(u64, u64, String)> = file
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0)
            .filter_map(|s| {
                Some((
                    s.address(),
                    s.address() + s.size(),
                    s.name().ok()?.to_owned(),
                ))
            })
            .collect();
        v.sort();
        Ok(Symbols(v))
    }

    /// The function holding `addr`.
    fn name(&self, addr: u64) -> &str {
        let i = self.0.partition_point(|(start, _, _)| *start <= addr);
        match i.checked_sub(1).map(|i| &self.0[i]) {
            Some((_, end, name)) if addr < *end => name,
            _ => "?",
        }
    }

    /// The functions of a guest chain: frame 0 as given when `first_is_ip` (an exit's RIP), every
    /// return address less one (the call instruction's last byte).
    fn chain(&self, frames: &[u64], first_is_ip: bool) -> Vec<String> {
        frames
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                let a = if i == 0 && first_is_ip { a } else { a - 1 };
                self.name(a).to_owned()
            })
            .collect()
    }
}

/// The index of the VM named `name` in the capture's header.
fn vm_index(d: &Decoded, name: &str) -> Result<u16, String> {
    d.header
        .as_ref()
        .and_then(|h| h.vms.iter().find(|v| v.name.as_str() == name))
        .map(|v| v.id)
        .ok_or_else(|| format!("no VM {name} in the capture's header"))
}

/// Every sample of VM `vm` with its guest chain's frames.
fn vm_samples(d: &Decoded, vm: u16) -> impl Iterator<Item = (&Sample, &[u64])> {
    d.pcpus
        .values()
        .flat_map(|log| log.samples_with_chains())
        .filter(move |(s, _)| s.vm == vm)
        .map(|(s, c)| (s, c.guest))
}

/// Samples of the known tree's VM `tree` at the instructions where a frame-pointer walk must
/// look at the code (a prologue's `push rbp` and `mov rbp, rsp`, the `ret` after `pop rbp`) of
/// `deep_leaf` and `leaf`: every one with its exact callers, whatever another VM running the same
/// image found at those addresses (`stacks plant=`, which runs NOPs there). At least `min` such
/// samples.
fn check_boundary_chains(run: &ProfileRun, min: u64) -> Result<(), String> {
    let d = hvprof_samplelog::decode(&run.capture);
    let vm = vm_index(&d, "tree")?;
    let syms = Symbols::read(&run.guest_dir.join("stacks"))?;
    let bounds = |name: &str| {
        syms.0
            .iter()
            .find(|(_, _, n)| n == name)
            .map(|&(start, end, _)| [start, start + 1, end - 1])
            .ok_or_else(|| format!("no symbol {name} in the stacks guest"))
    };
    let (deep, leaf) = (bounds("deep_leaf")?, bounds("leaf")?);
    let (mut all, mut wrong) = (0u64, Vec::new());
    for (s, frames) in vm_samples(&d, vm) {
        if s.kind != SampleKind::Guest {
            continue;
        }
        let callers = syms.chain(frames, false);
        let right = if deep.contains(&s.guest_rip) {
            callers.iter().take_while(|f| *f == "recurse").count() == DEPTH
                && callers.get(DEPTH).map(String::as_str) == Some("round")
        } else if leaf.contains(&s.guest_rip) {
            matches!(
                callers.first().map(String::as_str),
                Some("parent_a" | "parent_b")
            ) && callers.get(1).map(String::as_str) == Some("round")
        } else {
            continue;
        };
        all += 1;
        if !right {
            wrong.push(format!("{:#x}: {}", s.guest_rip, callers.join(" <- ")));
        }
    }
    if all < min {
        return Err(format!(
            "only {all} samples at deep_leaf's and leaf's prologues and returns (at least {min} wanted)"
        ));
    }
    if !wrong.is_empty() {
        return Err(format!(
            "{} of {all} samples at a prologue or return have wrong callers, e.g. {}",
            wrong.len(),
            wrong.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
        ));
    }
    Ok(())
}

/// The known tree, from the decoded capture and the guest's symbols.
fn check_tree_decoded(run: &ProfileRun) -> Result<(), String> {
    let d = hvprof_samplelog::decode(&run.capture);
    let vm = vm_index(&d, "tree")?;
    let syms = Symbols::read(&run.guest_dir.join("stacks"))?;
    let (mut from_a, mut from_b, mut deep, mut deep_right, mut nofp, mut nofp_right) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut cpuid, mut cpuid_right) = (0u64, 0u64);
    for (s, frames) in vm_samples(&d, vm) {
        match s.kind {
            SampleKind::Guest => {
                let leaf = syms.name(s.guest_rip);
                let callers = syms.chain(frames, false);
                let caller = callers.first().map_or("", String::as_str);
                match leaf {
                    "leaf" if caller == "parent_a" => from_a += 1,
                    "leaf" if caller == "parent_b" => from_b += 1,
                    "deep_leaf" => {
                        deep += 1;
                        let recursion = callers.iter().take_while(|f| *f == "recurse").count();
                        if recursion == DEPTH
                            && callers.get(DEPTH).map(String::as_str) == Some("round")
                        {
                            deep_right += 1;
                        }
                    }
                    "nofp_leaf" => {
                        nofp += 1;
                        // `nofp` keeps no frame record: its caller `nofp_caller` is skipped, the
                        // walk goes on at `round`.
                        if callers
                            .iter()
                            .take(2)
                            .map(String::as_str)
                            .eq(["nofp", "round"])
                        {
                            nofp_right += 1;
                        }
                    }
                    _ => {}
                }
            }
            SampleKind::Hypervisor if s.exit_reason == EXIT_CPUID && !frames.is_empty() => {
                cpuid += 1;
                let chain = syms.chain(frames, true);
                if chain
                    .iter()
                    .take(2)
                    .map(String::as_str)
                    .eq(["cpuid_loop", "round"])
                {
                    cpuid_right += 1;
                }
            }
            _ => {}
        }
    }
    let mut errors = Vec::new();
    if from_a + from_b < 1000 {
        errors.push(format!(
            "only {} samples in leaf with a caller: too few to judge",
            from_a + from_b
        ));
    } else {
        let share = 100.0 * from_a as f64 / (from_a + from_b) as f64;
        errors.extend(within("parent_a's share of leaf (decoded)", share, 70.0, TOLERANCE).err());
    }
    let most = |what: &str, right: u64, all: u64, min: u64| {
        if all < min {
            Some(format!("only {all} samples of {what}: too few to judge"))
        } else if (right as f64) < 0.99 * all as f64 {
            Some(format!(
                "{what}: {right} of {all} samples have the expected chain"
            ))
        } else {
            None
        }
    };
    errors.extend(most(
        "deep_leaf under exactly 4 recurse frames",
        deep_right,
        deep,
        300,
    ));
    errors.extend(most(
        "nofp_leaf under nofp then round",
        nofp_right,
        nofp,
        150,
    ));
    // Hypervisor samples taken while it handled a CPUID exit of `cpuid_loop`: nearly all of them
    // (a sample can land in an exit's handling just after the guest moved on, at the next exit).
    if cpuid < 100 {
        errors.push(format!(
            "only {cpuid} hypervisor samples during CPUID exits"
        ));
    } else if (cpuid_right as f64) < 0.95 * cpuid as f64 {
        errors.push(format!(
            "exit cause: {cpuid_right} of {cpuid} samples of CPUID handling name cpuid_loop called from round"
        ));
    }
    all_of(errors.into_iter().map(Err))
}

/// The call graph of the report's JSON: samples of the edge `caller -> callee` at `level`.
pub(crate) fn edge(report: &Value, level: &str, caller: &str, callee: &str) -> f64 {
    report
        .pointer("/call_graph/edges")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|e| {
            e.get("level").and_then(Value::as_str) == Some(level)
                && e.get("caller").and_then(Value::as_str) == Some(caller)
                && e.get("callee").and_then(Value::as_str) == Some(callee)
        })
        .filter_map(|e| e.get("samples").and_then(Value::as_f64))
        .sum()
}

/// The known tree, as `hvprof-analyze report --json --call-graph` shows it.
fn check_tree_report(run: &ProfileRun) -> Result<(), String> {
    let report = run.report_with(None, &["--call-graph".into()])?;
    let mut errors = Vec::new();
    // The VM level, then the host level, where the VM's functions are named with it.
    for (level, suffix) in [("tree", ""), ("host", " [tree]")] {
        let edge = |caller: &str, callee: &str| {
            edge(
                &report,
                level,
                &format!("{caller}{suffix}"),
                &format!("{callee}{suffix}"),
            )
        };
        let a = edge("parent_a", "leaf");
        let b = edge("parent_b", "leaf");
        if a + b < 1000.0 {
            errors.push(format!(
                "{level} level: {a} + {b} samples on the edges into leaf: expected thousands"
            ));
            continue;
        }
        errors.extend(
            within(
                &format!("{level} level: parent_a -> leaf share of leaf's callers"),
                100.0 * a / (a + b),
                70.0,
                TOLERANCE,
            )
            .err(),
        );
        // Every deep_leaf sample runs under the whole recursion (the samples in `recurse` itself
        // add to the edges above it).
        let deep_calls = edge("recurse", "deep_leaf");
        let recursion = edge("recurse", "recurse");
        let entry = edge("round", "recurse");
        if deep_calls < 300.0 || recursion < deep_calls || entry < recursion {
            errors.push(format!(
                "{level} level: recurse edges round->recurse {entry}, recurse->recurse {recursion}, recurse->deep_leaf {deep_calls}: expected the recursion on every deep_leaf sample"
            ));
        }
        // `nofp` keeps no frame record: only its samples at its `ret` (where the walk reads its
        // return address at RSP) find `nofp_caller`; those in `nofp_leaf` skip it.
        let under_leaf = edge("nofp", "nofp_leaf");
        let found = edge("nofp_caller", "nofp");
        if under_leaf < 150.0 || found > 0.05 * under_leaf {
            errors.push(format!(
                "{level} level: nofp -> nofp_leaf {under_leaf}, nofp_caller -> nofp {found}: expected nofp_caller found only by nofp's few samples at its ret (nofp keeps no frame record)"
            ));
        }
    }
    let causes: Vec<&Value> = report
        .pointer("/call_graph/exit_causes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|c| {
            c.get("vm").and_then(Value::as_str) == Some("tree")
                && c.get("exit_reason").and_then(Value::as_str) == Some("CPUID")
        })
        .collect();
    let total: f64 = causes
        .iter()
        .filter_map(|c| c.get("samples").and_then(Value::as_f64))
        .sum();
    let named: f64 = causes
        .iter()
        .filter(|c| {
            c.get("guest_function").and_then(Value::as_str) == Some("cpuid_loop")
                && c.get("guest_caller").and_then(Value::as_str) == Some("round")
        })
        .filter_map(|c| c.get("samples").and_then(Value::as_f64))
        .sum();
    if total < 100.0 || named < 0.95 * total {
        errors.push(format!(
            "exit causes: {named} of {total} samples of CPUID handling in VM tree name cpuid_loop called from round"
        ));
    }
    all_of(errors.into_iter().map(Err))
}

/// The marker return addresses of `stackattack`: phase and record.
fn marker(frame: u64) -> Option<(u64, u64)> {
    (frame >> 16 == 0x4141).then_some(((frame >> 12) & 0xf, frame & 0xfff))
}

/// The hostile chains: each phase's chains have exactly the expected frames and end, whatever
/// sample (guest, or hypervisor during the attacker's exits) walked them.
fn check_attack(run: &ProfileRun) -> Result<(), String> {
    let d = hvprof_samplelog::decode(&run.capture);
    let vm = vm_index(&d, "attacker")?;
    let mut seen = [0u64; 6];
    let mut errors: Vec<String> = Vec::new();
    let mut chains = 0u64;
    for log in d.pcpus.values() {
        for (s, c) in log.samples_with_chains() {
            if s.vm != vm {
                continue;
            }
            chains += 1;
            // The forged records follow the leaf's frame (the spin function's return into the
            // guest, or at an exit the exit's RIP).
            let Some(start) = c.guest.iter().position(|&f| marker(f).is_some()) else {
                continue;
            };
            let forged = &c.guest[start..];
            let Some((phase, _)) = marker(forged[0]) else {
                continue;
            };
            let want: Vec<u64> = match phase {
                1 => vec![0x4141_1000],
                2 => vec![0x4141_2000, 0x4141_2001],
                3 => vec![0x4141_3000],
                4 => vec![0x4141_4000],
                5 => (0..16 - start as u64).map(|i| 0x4141_5000 + i).collect(),
                _ => vec![],
            };
            let want_end = if phase == 5 {
                ChainEnd::DepthLimit
            } else {
                ChainEnd::BadFrame
            };
            seen[phase as usize] += 1;
            if (forged != want.as_slice() || s.guest_chain.end() != want_end) && errors.len() < 5 {
                errors.push(format!(
                    "phase {phase}: chain {forged:#x?} ending {:?}, expected {want:#x?} ending {want_end:?}",
                    s.guest_chain.end()
                ));
            }
        }
    }
    for (phase, n) in seen.iter().enumerate().skip(1) {
        if *n < 30 {
            errors.push(format!(
                "phase {phase}: only {n} samples walked its chain (of {chains} samples of the attacker)"
            ));
        }
    }
    all_of(errors.into_iter().map(Err))
}

pub fn all() -> Vec<Scenario> {
    vec![
        Scenario::new("bochs-stacks-known-tree", Emulator::bochs(HASWELL))
            .cmdline("export=end stacks=16")
            .module(
                "stacks.elf",
                ModuleSource::Guest("stacks"),
                &format!("vm=tree rounds=600 depth={DEPTH} cpuid=20"),
            )
            .check(|log| check_exit_code(log, "tree", 0, "port 0xf4"))
            .check(|log| {
                log.expect("profiler: call chains walked")?;
                Ok(())
            })
            .profile(|run| all_of([check_tree_decoded(run), check_tree_report(run)])),
        // Guests against guests, 4: a VM running the same image at the same CR3 with NOPs where
        // the known tree has its prologues and returns (its walks find that code ordinary),
        // taking turns with it on one pCPU.
        Scenario::new("bochs-attack-walk-cache", Emulator::bochs(HASWELL))
            .cmdline("export=end stacks=16 slice=1ms")
            .module(
                "stacks.elf",
                ModuleSource::Guest("stacks"),
                // Short calls (one iteration per weight point), so that a tenth of the
                // samples fall on a prologue or a return.
                &format!("vm=tree rounds=150000 unit=1 depth={DEPTH} cpuid=0"),
            )
            .module(
                "planter.elf",
                ModuleSource::Guest("stacks"),
                "vm=planter plant=300000",
            )
            .check(|log| check_exit_code(log, "tree", 0, "port 0xf4"))
            .check(|log| check_exit_code(log, "planter", 0, "port 0xf4"))
            .profile(|run| check_boundary_chains(run, 20)),
        Scenario::new("bochs-attack-stack", Emulator::bochs(HASWELL))
            .cmdline("export=end stacks=16")
            .module(
                "victim.elf",
                ModuleSource::Guest("mix"),
                "vm=victim mix=50,50 rounds=20",
            )
            .module(
                "stackattack.elf",
                ModuleSource::Guest("stackattack"),
                "vm=attacker rounds=30 target=vm:victim",
            )
            .check(|log| check_exit_code(log, "victim", 0, "port 0xf4"))
            .check(|log| check_exit_code(log, "attacker", 0, "port 0xf4"))
            .check(|log| {
                let line = log.expect("vm attacker: target VM victim's memory")?;
                if line.ends_with("unchanged") {
                    Ok(())
                } else {
                    Err(format!("the victim's page changed: {line:?}"))
                }
            })
            .profile(check_attack),
        // A kernel whose ORC tables (its own memory, `orc-layout=` given as for Linux) make a
        // walk read 23 words a frame, beside a victim on the same pCPU: the profiler stops
        // each walk at its read budget, well before the 32 frames `stacks=32` allows.
        Scenario::new("bochs-attack-walk-budget", Emulator::bochs(HASWELL))
            .cmdline("export=end stacks=32 period=200000ticks")
            .module(
                "victim.elf",
                ModuleSource::Guest("mix"),
                "vm=victim mix=50,50 rounds=10",
            )
            .module(
                "orcattack.elf",
                ModuleSource::Guest("orcattack"),
                &format!("vm=attacker mem=64M orc-layout={ORC_ATTACK_LAYOUT} rounds=40"),
            )
            .check(|log| check_exit_code(log, "victim", 0, "port 0xf4"))
            .check(|log| check_exit_code(log, "attacker", 0, "port 0xf4"))
            .check(|log| check_walk_budget(log, 50)),
    ]
}

/// `orcattack`'s tables and text (`guests/src/bin/orcattack.rs`).
const ORC_ATTACK_LAYOUT: &str = "0xffffffff80001000:0xffffffff81f80000:0xffffffff81f80100:0xffffffff80000000:0xffffffff81000000:0xffffffff81000000:0xffffffff81800000:1048576:0xffffffff81f00000:2";

/// The kernel walks' read budget (`KERNEL_WALK_READS` in the sampler).
const KERNEL_WALK_READS: u32 = 640;

/// The hypervisor's closing line on the walks' read budgets: no kernel walk read more than
/// `KERNEL_WALK_READS`, and at least `stopped` walks were stopped there.
fn check_walk_budget(log: &SerialLog, stopped: u64) -> Result<(), String> {
    let line =
        log.expect("profiler: read budgets of walks by unwind tables: kernel (ORC) at most ")?;
    let rest = line
        .split_once("kernel (ORC) at most ")
        .map(|(_, r)| r)
        .unwrap_or_default();
    let words: Vec<&str> = rest.split_whitespace().collect();
    let (Some(most), Some(n)) = (
        words.first().and_then(|w| w.parse::<u32>().ok()),
        words
            .iter()
            .position(|w| *w == "walks")
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| words[i].trim_start_matches(',').parse::<u64>().ok()),
    ) else {
        return Err(format!("cannot read the budget line: {line}"));
    };
    if most > KERNEL_WALK_READS {
        return Err(format!(
            "a kernel walk read {most} words, over the budget of {KERNEL_WALK_READS}: {line}"
        ));
    }
    if n < stopped {
        return Err(format!(
            "{n} kernel walks stopped at the budget, expected at least {stopped} (the attacker's samples): {line}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_name_their_phase() {
        assert_eq!(marker(0x4141_5003), Some((5, 3)));
        assert_eq!(marker(0x4141_1000), Some((1, 0)));
        assert_eq!(marker(0x20_0015), None);
    }

    #[test]
    fn symbols_name_return_addresses_by_the_call() {
        let s = Symbols(vec![(0x100, 0x110, "a".into()), (0x110, 0x120, "b".into())]);
        // A return address just past `a`'s last call is `b`'s first byte: still `a`.
        assert_eq!(s.chain(&[0x110, 0x118], false), vec!["a", "b"]);
        assert_eq!(s.chain(&[0x110], true), vec!["b"]);
        assert_eq!(s.name(0x120), "?");
        assert_eq!(s.name(0x50), "?");
    }
}
