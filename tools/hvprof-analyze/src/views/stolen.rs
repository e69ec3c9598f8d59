//! `report --stolen`: who held each vCPU's pCPU while the vCPU was out but runnable (its
//! steal), and what they ran there. The scheduling events give each stretch out (from the
//! vCPU's "out", preempted or yielded, to its next event) and the pCPU it left; the samples
//! are read again in TSC order (`Profile::replay`) and every sample of that pCPU inside the
//! stretch is charged to the vCPU's steal, by holder: another vCPU's guest code (its VM,
//! vCPU and function), the hypervisor working for a vCPU (by exit reason and function), the
//! hypervisor working for no VM (by function: the scheduler, export, console, ...), or no one
//! (the pCPU idle). Per pCPU, the same as a matrix: each vCPU's steal there by the VM that
//! held the pCPU.
//!
//! The shares are of the vCPU's steal samples on the pCPU it left (a vCPU that another pCPU
//! took up ends its stretch there). Reading the samples again costs a second pass, so the view
//! is asked for.

use std::collections::BTreeMap;

use anyhow::Result;
use hvprof_samplelog::NO_VM;
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;

use crate::model::profile::Profile;
use crate::model::samples::{Sampled, What};
use crate::model::timeline::{Stretch, out_stretches};
use crate::naming::namer::exit_name;

/// Who held a pCPU in one sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Holder {
    /// A vCPU's guest code.
    Guest(u16, u16),
    /// The hypervisor, working for a vCPU (handling its exits).
    Hypervisor(u16, u16),
    /// The hypervisor, for no VM.
    HypervisorNoVm,
    /// No one: the pCPU idle.
    Idle,
}

impl Holder {
    fn of(s: &Sampled) -> Holder {
        match s.what {
            What::GuestKernel | What::GuestUser => Holder::Guest(s.vm, s.vcpu),
            What::Hypervisor if s.vm == NO_VM => Holder::HypervisorNoVm,
            What::Hypervisor => Holder::Hypervisor(s.vm, s.vcpu),
            What::Idle => Holder::Idle,
        }
    }

    /// Its name, and the name of the matrix column it falls in.
    fn names(self, p: &Profile) -> (String, String) {
        match self {
            Holder::Guest(vm, c) => (format!("{} vCPU {c}", p.vm_name(vm)), p.vm_name(vm)),
            Holder::Hypervisor(vm, c) => (
                format!("the hypervisor for {} vCPU {c}", p.vm_name(vm)),
                "the hypervisor".to_owned(),
            ),
            Holder::HypervisorNoVm => ("the hypervisor".to_owned(), "the hypervisor".to_owned()),
            Holder::Idle => ("no one (idle)".to_owned(), "no one (idle)".to_owned()),
        }
    }
}

/// One holder of a vCPU's pCPU in one function while the vCPU was out.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Held {
    /// "VM vCPU N", "the hypervisor for VM vCPU N", "the hypervisor" or "no one (idle)".
    pub holder: String,
    pub function: String,
    pub module: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub process: String,
    /// The exit the hypervisor was handling (its samples for a vCPU).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit: Option<String>,
    pub samples: u64,
    /// Share of the vCPU's steal samples.
    pub percent: f64,
}

/// A holder's total share of a vCPU's steal.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HolderTotal {
    pub holder: String,
    pub samples: u64,
    pub percent: f64,
}

/// One vCPU's steal by who held its pCPU.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VcpuStolen {
    pub vm: String,
    pub vcpu: u16,
    /// Samples of the pCPU it left, while it was out and runnable.
    pub samples: u64,
    /// By holder, most samples first.
    pub holders: Vec<HolderTotal>,
    /// By holder and function, most samples first.
    pub rows: Vec<Held>,
}

/// One cell of a pCPU's matrix: `samples` of `victim`'s steal there held by `holder` (a VM's
/// name, "the hypervisor" or "no one (idle)"), `percent` of the victim's steal samples there.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Cell {
    pub victim: String,
    pub holder: String,
    pub samples: u64,
    pub percent: f64,
}

/// Who stole from whom on one pCPU.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PcpuStolen {
    pub pcpu: u16,
    /// The rows (victims, "VM vCPU N") and columns (holders) in order, and the cells that are
    /// not empty.
    pub victims: Vec<String>,
    pub holders: Vec<String>,
    pub cells: Vec<Cell>,
}

impl PcpuStolen {
    /// The share of `victim`'s steal here that `holder` held (0 for an empty cell).
    #[must_use]
    pub fn share(&self, victim: &str, holder: &str) -> f64 {
        self.cells
            .iter()
            .find(|x| x.victim == victim && x.holder == holder)
            .map_or(0.0, |x| x.percent)
    }
}

/// The view: per vCPU, and per pCPU.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Stolen {
    pub vcpus: Vec<VcpuStolen>,
    pub pcpus: Vec<PcpuStolen>,
}

/// Per victim vCPU, its steal samples by (pCPU, holder, frame, exit reason).
type Counts = HashMap<(u16, u16), HashMap<(u16, Holder, u32, u16), u64>>;

/// One pCPU's matrix: per (victim vCPU, holder column), samples.
type Column = BTreeMap<((u16, u16), String), u64>;

/// What one sample says about the stretches it falls in.
#[derive(Clone, Copy)]
struct Seen {
    tsc: u64,
    pcpu: u16,
    holder: Holder,
    frame: u32,
    exit: u16,
}

fn percent(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * n as f64 / of as f64
    }
}

/// The pass over the samples in TSC order: per victim vCPU, the samples inside its stretches out
/// (sorted by start) on the pCPU it left, by (pCPU, holder, frame, exit). Fed run after run, it
/// keeps the stretches open at the last sample.
struct Sweep<'a> {
    outs: &'a [Stretch],
    next: usize,
    active: HashMap<u16, Vec<Stretch>>,
    counts: Counts,
}

impl<'a> Sweep<'a> {
    fn new(outs: &'a [Stretch]) -> Self {
        Sweep {
            outs,
            next: 0,
            active: HashMap::default(),
            counts: Counts::default(),
        }
    }

    /// The next samples, in TSC order after those fed before.
    fn feed(&mut self, seen: impl Iterator<Item = Seen>) {
        for s in seen {
            while let Some(o) = self.outs.get(self.next).filter(|o| o.start <= s.tsc) {
                self.active.entry(o.pcpu).or_default().push(*o);
                self.next += 1;
            }
            let Some(here) = self.active.get_mut(&s.pcpu) else {
                continue;
            };
            here.retain(|o| o.end > s.tsc);
            for o in here.iter() {
                // Its own guest samples while out: a forged log.
                if s.holder == Holder::Guest(o.vcpu.0, o.vcpu.1) {
                    continue;
                }
                *self
                    .counts
                    .entry(o.vcpu)
                    .or_default()
                    .entry((s.pcpu, s.holder, s.frame, s.exit))
                    .or_default() += 1;
            }
        }
    }
}

/// Who held every vCPU's pCPU while it was out and runnable.
pub fn build(p: &Profile) -> Result<Stolen> {
    let outs = out_stretches(&p.events);
    if outs.is_empty() {
        return Ok(Stolen::default());
    }
    let mut sweep = Sweep::new(&outs);
    p.replay(
        |run: &[Sampled], seen: &mut Vec<Seen>| {
            seen.clear();
            seen.extend(run.iter().map(|s| Seen {
                tsc: s.tsc,
                pcpu: s.pcpu,
                holder: Holder::of(s),
                frame: s.frame,
                exit: if s.what == What::Hypervisor && s.vm != NO_VM {
                    s.exit
                } else {
                    0
                },
            }));
        },
        |seen| {
            sweep.feed(seen.drain(..));
            Ok(())
        },
    )?;
    Ok(shape(p, sweep.counts))
}

/// The counts named and sorted.
fn shape(p: &Profile, counts: Counts) -> Stolen {
    let victim_name = |(vm, c): (u16, u16)| format!("{} vCPU {c}", p.vm_name(vm));
    let mut vcpus = Vec::new();
    // Per pCPU, per (victim, column): samples; and per (pCPU, victim) the total.
    let mut matrix: BTreeMap<u16, Column> = BTreeMap::new();
    let mut victims: Vec<(u16, u16)> = counts.keys().copied().collect();
    victims.sort_unstable();
    for victim in victims {
        let by = &counts[&victim];
        let samples: u64 = by.values().sum();
        let mut holders: HashMap<String, u64> = HashMap::default();
        let mut rows: HashMap<(String, String, String, String, Option<String>), u64> =
            HashMap::default();
        for (&(pcpu, holder, frame, exit), &n) in by {
            let (mut name, column) = holder.names(p);
            if holder == Holder::Hypervisor(victim.0, victim.1) {
                name = "the hypervisor (finishing its exit)".to_owned();
            }
            *holders.entry(name.clone()).or_default() += n;
            *matrix
                .entry(pcpu)
                .or_default()
                .entry((victim, column))
                .or_default() += n;
            let (function, module, process) = match holder {
                Holder::Idle => ("[idle]".to_owned(), "(idle)".to_owned(), String::new()),
                _ => match p.frames.get(frame as usize) {
                    Some(f) => (f.function.clone(), f.module.clone(), f.process.clone()),
                    None => ("[unknown]".to_owned(), String::new(), String::new()),
                },
            };
            let exit = matches!(holder, Holder::Hypervisor(..)).then(|| exit_name(exit));
            *rows
                .entry((name, function, module, process, exit))
                .or_default() += n;
        }
        let mut holders: Vec<HolderTotal> = holders
            .into_iter()
            .map(|(holder, n)| HolderTotal {
                holder,
                samples: n,
                percent: percent(n, samples),
            })
            .collect();
        holders.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.holder.cmp(&b.holder)));
        let mut rows: Vec<Held> = rows
            .into_iter()
            .map(|((holder, function, module, process, exit), n)| Held {
                holder,
                function,
                module,
                process,
                exit,
                samples: n,
                percent: percent(n, samples),
            })
            .collect();
        rows.sort_by(|a, b| {
            b.samples
                .cmp(&a.samples)
                .then_with(|| a.holder.cmp(&b.holder))
                .then_with(|| a.function.cmp(&b.function))
                .then_with(|| a.exit.cmp(&b.exit))
        });
        vcpus.push(VcpuStolen {
            vm: p.vm_name(victim.0),
            vcpu: victim.1,
            samples,
            holders,
            rows,
        });
    }
    let pcpus = matrix
        .into_iter()
        .map(|(pcpu, cells)| {
            let mut totals: BTreeMap<(u16, u16), u64> = BTreeMap::new();
            let mut columns: Vec<String> = Vec::new();
            for ((victim, column), n) in &cells {
                *totals.entry(*victim).or_default() += n;
                if !columns.contains(column) {
                    columns.push(column.clone());
                }
            }
            // The VMs in the capture's order, then the hypervisor and idle.
            let rank = |c: &String| {
                p.vms
                    .iter()
                    .position(|v| &v.name == c)
                    .unwrap_or(p.vms.len() + usize::from(c != "the hypervisor"))
            };
            columns.sort_by_key(|c| (rank(c), c.clone()));
            PcpuStolen {
                pcpu,
                victims: totals.keys().map(|&v| victim_name(v)).collect(),
                holders: columns,
                cells: cells
                    .into_iter()
                    .map(|((victim, holder), n)| Cell {
                        victim: victim_name(victim),
                        holder,
                        samples: n,
                        percent: percent(n, totals[&victim]),
                    })
                    .collect(),
            }
        })
        .collect();
    Stolen { vcpus, pcpus }
}

/// The text view: per vCPU, its steal by holder and the top `top` (holder, function) rows;
/// then per pCPU, the matrix.
pub fn render(s: &Stolen, top: usize) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for v in &s.vcpus {
        let who: Vec<String> = v
            .holders
            .iter()
            .map(|h| format!("{} {:.2}%", h.holder, h.percent))
            .collect();
        let _ = writeln!(
            out,
            "\nStolen from: VM {} vCPU {}: {} samples of its pCPU while it was out and runnable, held by {}",
            v.vm,
            v.vcpu,
            v.samples,
            who.join(", ")
        );
        let rows = &v.rows[..v.rows.len().min(top)];
        let holder = rows
            .iter()
            .map(|r| r.holder.len())
            .max()
            .unwrap_or(0)
            .max(7);
        let function = rows
            .iter()
            .map(|r| r.function.len())
            .max()
            .unwrap_or(0)
            .max(8);
        let module = rows
            .iter()
            .map(|r| r.module.len())
            .max()
            .unwrap_or(0)
            .max(6);
        let _ = writeln!(
            out,
            " %Steal   Samples  {:<holder$}  {:<function$}  {:<module$}  Process",
            "Held by", "Function", "Module"
        );
        for r in rows {
            let _ = writeln!(
                out,
                " {:>6.2}  {:>8}  {:<holder$}  {:<function$}  {:<module$}  {}",
                r.percent, r.samples, r.holder, r.function, r.module, r.process
            );
        }
        if v.rows.len() > top {
            let _ = writeln!(out, "  ... {} more rows (--top)", v.rows.len() - top);
        }
    }
    for c in &s.pcpus {
        let _ = writeln!(
            out,
            "\nWho stole from whom on pCPU {} (% of each row's steal samples there):",
            c.pcpu
        );
        let width = c.victims.iter().map(String::len).max().unwrap_or(0).max(8);
        let _ = write!(out, " {:<width$}", "held by:");
        for h in &c.holders {
            let _ = write!(out, "  {h:>12}");
        }
        out.push('\n');
        for v in &c.victims {
            let _ = write!(out, " {v:<width$}");
            for h in &c.holders {
                let _ = write!(out, "  {:>12.2}", c.share(v, h));
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep of `seen` in one piece.
    fn tally(outs: &[Stretch], seen: impl Iterator<Item = Seen>) -> Counts {
        let mut s = Sweep::new(outs);
        s.feed(seen);
        s.counts
    }

    fn seen(tsc: u64, pcpu: u16, holder: Holder) -> Seen {
        Seen {
            tsc,
            pcpu,
            holder,
            frame: 0,
            exit: 0,
        }
    }

    fn out(vcpu: (u16, u16), pcpu: u16, start: u64, end: u64) -> Stretch {
        Stretch {
            vcpu,
            pcpu,
            start,
            end,
        }
    }

    #[test]
    fn charges_the_samples_of_the_pcpu_left_inside_each_stretch() {
        // vm0 vCPU 0 out on pCPU 0 over [10, 40); vm1 vCPU 0 out on pCPU 0 over [40, 60).
        let outs = [out((0, 0), 0, 10, 40), out((1, 0), 0, 40, 60)];
        let samples = [
            seen(5, 0, Holder::Guest(0, 0)),       // before: no one's steal
            seen(10, 0, Holder::Hypervisor(0, 0)), // vm0 finishing its exit
            seen(20, 0, Holder::Guest(1, 0)),
            seen(25, 1, Holder::Guest(2, 0)), // another pCPU: not vm0's steal
            seen(30, 0, Holder::Guest(1, 0)),
            seen(39, 0, Holder::Idle),
            seen(40, 0, Holder::Guest(0, 0)), // vm0 back; vm1 out
            seen(59, 0, Holder::HypervisorNoVm),
            seen(60, 0, Holder::Guest(1, 0)), // vm1 back
        ];
        let t = tally(&outs, samples.into_iter());
        let of = |v: (u16, u16), h: Holder| t[&v].get(&(0, h, 0, 0)).copied().unwrap_or(0);
        assert_eq!(of((0, 0), Holder::Guest(1, 0)), 2);
        assert_eq!(of((0, 0), Holder::Hypervisor(0, 0)), 1);
        assert_eq!(of((0, 0), Holder::Idle), 1);
        assert_eq!(t[&(0, 0)].values().sum::<u64>(), 4);
        assert_eq!(of((1, 0), Holder::Guest(0, 0)), 1);
        assert_eq!(of((1, 0), Holder::HypervisorNoVm), 1);
        assert_eq!(t[&(1, 0)].values().sum::<u64>(), 2);
    }

    #[test]
    fn two_vcpus_out_at_once_each_get_the_holder() {
        let outs = [out((0, 0), 0, 0, 100), out((1, 0), 0, 0, 100)];
        let t = tally(&outs, [seen(50, 0, Holder::Guest(2, 0))].into_iter());
        assert_eq!(t[&(0, 0)].values().sum::<u64>(), 1);
        assert_eq!(t[&(1, 0)].values().sum::<u64>(), 1);
    }

    #[test]
    fn the_sweep_in_pieces_counts_as_in_one() {
        let outs: Vec<Stretch> = (0..50u64)
            .map(|i| out(((i % 3) as u16, 0), (i % 2) as u16, i * 10, i * 10 + 35))
            .collect();
        let samples: Vec<Seen> = (0..600u64)
            .map(|t| seen(t, (t % 2) as u16, Holder::Guest(((t / 7) % 4) as u16, 0)))
            .collect();
        let whole = tally(&outs, samples.iter().copied());
        let mut pieces = Sweep::new(&outs);
        for chunk in samples.chunks(37) {
            pieces.feed(chunk.iter().copied());
        }
        assert_eq!(whole, pieces.counts);
    }
}
