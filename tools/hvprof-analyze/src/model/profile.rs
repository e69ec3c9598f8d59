//! Every sample of a capture, named: the model the report, the charts and the export formats
//! are drawn from, with what the capture lost, its warnings and its cost. [`Profile::load`] reads
//! a capture: who ran (its frames other than the blocks), the first pass
//! ([`crate::model::first_pass`]), the stacks named ([`crate::model::stack_names`]) and their
//! call chains ([`Calls`]), each vCPU's blank slots on the time axis.
//!
//! Samples with call chains (format 3) keep them in their key: each distinct pair of chains
//! (the hypervisor's frames, the guest's, and how each walk ended) is numbered once
//! ([`Samples::chain`]), so memory grows with the distinct stacks, not the samples. Their frames
//! are named once per distinct address and context ([`Calls`]): a return address as the call
//! instruction before it (`addr - 1`, as perf does), in the symbols of the sample's leaf (the
//! hypervisor's for host frames; the VM's image, Linux kernel or process for guest frames; for a
//! hypervisor sample on a vCPU's exit, its guest frames in that vCPU's context, the first being
//! the guest RIP at the exit, named as it is).

use anyhow::Result;
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::Event;

use crate::model::calls::Calls;
use crate::model::capture::Capture;
use crate::model::cost::{CostSum, WholeCost};
use crate::model::first_pass::{Classified, Keep};
use crate::model::integrity::Integrity;
use crate::model::losses::{LossRange, Lost, losses};
use crate::model::merge::sort_events;
use crate::model::progress::Progress;
use crate::model::replay::Replay;
use crate::model::samples::{Frame, Sampled, Samples, Stack, is_guest};
use crate::model::timeline::Blanks;
use crate::model::window::{TimeRange, Window};
use crate::naming::namer::{Namer, Processes, VmMeta};
use crate::naming::symbols::{Images, hex};

/// A whole capture, named.
pub struct Profile {
    pub tsc_hz: u64,
    pub period_ticks: u64,
    pub pcpus: u16,
    pub vms: Vec<VmMeta>,
    /// The distinct samples, with their counts.
    pub samples: Samples,
    pub frames: Vec<Frame>,
    /// The call chains' frames, named (empty for a capture without chains, and for the report
    /// alone: `LoadOptions::report_only`).
    pub calls: Calls,
    /// Every scheduling event with its pCPU, in TSC order (in stream order for a profile
    /// loaded for the report alone: `LoadOptions::report_only`, which reads them only to
    /// build the report).
    pub events: Vec<(u16, Event)>,
    /// The console text of the capture (shown, never read for data).
    pub text: String,
    /// The VM end frames: exit tables, LSTAR, task offsets.
    pub vm_ends: Vec<hvprof_samplelog::VmEnd>,
    /// The frames found in the capture, whole (0: no hvprof frame at all, whatever the file is).
    pub frames_found: u64,
    /// The sample source the header names: `deadline` or `pmu`.
    pub source: &'static str,
    /// The hypervisor's build id in the header, in hex.
    pub hypervisor_build_id: String,
    /// Whether the `--hypervisor` ELF has that build id (`None` without one).
    pub hypervisor_build_id_matches: Option<bool>,
    /// What the capture lost, in all.
    pub lost: Lost,
    /// Where records are missing, per pCPU, in host time.
    pub losses: Vec<LossRange>,
    /// Signs of a forged or damaged capture.
    pub integrity: Integrity,
    /// The sample path's cost over the samples.
    pub cost: CostSum,
    /// The profiler's whole cost, from the hypervisor's cost frames (`None` without them).
    pub whole_cost: Option<WholeCost>,
    /// Warnings for the reader: first where records were lost, then signs of a forged log
    /// (`integrity`), then missing symbols, mismatched build ids, truncation.
    pub warnings: Vec<String>,
    /// The stretch of host time shown (`--time START,END`), when not the whole run.
    pub time: Option<TimeRange>,
    /// Each vCPU's blank slots (`[idle]`, `[steal]`) on the common time axis, counted from the
    /// scheduling events ([`crate::model::timeline::segment_blanks`]): with
    /// [`LoadOptions::tables`], when the capture has events (`None` otherwise).
    pub blanks: Option<HashMap<(u16, u16), Blanks>>,
    /// What reads the samples again in order: the capture and where its blocks are.
    pub(super) replay: Replay,
}

/// How a capture is read. `keep_guest` names Linux guests' samples by process in the report
/// (the command line always asks for it, as the other views always do; without it the report
/// names them by address). `tables` builds the report's tables
/// (host level, each VM's and vCPU's, with `[steal]` and `[idle]` on the common time axis);
/// without it (the exports) the report has its totals, losses and warnings only.
/// `report_only` names only the stacks the report reads (the hypervisor's, and Linux guests'
/// with `keep_guest`; the report names the others by address): the others' frame is a
/// placeholder, and the events are left in stream order, so the profile is for the report
/// alone.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub threads: usize,
    pub keep_guest: bool,
    pub tables: bool,
    pub report_only: bool,
    /// Only the samples of this stretch of host time (`--time`, [`crate::model::window`]).
    pub time: Option<crate::model::window::TimeRange>,
    /// Only the first rows of each guest table of the report (the text report shows no more;
    /// the others are counted, and only the rows kept are named): `None` for every row.
    pub top_rows: Option<usize>,
    /// Keep each sample's TSC and stack from the first pass (8 bytes a sample): what the views
    /// that read the samples again in TSC order ([`Profile::replay`]: `script`, the timeline,
    /// the Firefox profile, `--preemptions`) read, so that no sample is decoded or classified
    /// twice. Without it the profile's samples cannot be read again (its replay is an error).
    pub keep_samples: bool,
}

impl LoadOptions {
    /// Every view's data on `threads` threads, the whole capture, guest processes by address
    /// space.
    #[must_use]
    pub const fn all(threads: usize) -> LoadOptions {
        LoadOptions {
            threads,
            keep_guest: false,
            tables: true,
            report_only: false,
            time: None,
            top_rows: None,
            keep_samples: true,
        }
    }
}

impl Profile {
    /// Reads and names a capture file.
    pub fn load(
        path: &std::path::Path,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<Profile> {
        Self::load_with_namer(path, images, options, progress).map(|(p, _)| p)
    }

    /// [`Profile::load`], and the namer that named it (see [`Profile::from_capture_with_namer`]).
    pub fn load_with_namer<'i>(
        path: &std::path::Path,
        images: &'i Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<(Profile, Namer<'i>)> {
        let bytes = Capture::open(path)?;
        let len = bytes.len();
        let (profile, namer) = Self::from_capture_with_namer(bytes, images, options, progress);
        profile.is_capture(path)?;
        if profile.samples.is_empty()
            && let Some(range) = options.time
        {
            // The capture has samples, outside the stretch (the warning says where they are).
            let why = profile
                .warnings
                .iter()
                .find(|w| w.starts_with("--time "))
                .cloned()
                .unwrap_or_else(|| format!("--time {range}: no samples in this stretch"));
            anyhow::bail!("{}: {why}", path.display());
        }
        if profile.samples.is_empty() {
            anyhow::bail!(
                "{}: no samples in this capture ({} bytes{}): is it an hvprof serial log?",
                path.display(),
                len,
                if profile.lost.truncated {
                    ", no end frame"
                } else {
                    ""
                }
            );
        }
        Ok((profile, namer))
    }

    /// An error unless the file at `path` held at least one hvprof frame: a capture whose
    /// samples were all lost still has its report (what was lost), a file of anything else
    /// (a wrong path, the console log of another program) has none.
    pub fn is_capture(&self, path: &std::path::Path) -> Result<()> {
        if self.frames_found == 0 {
            anyhow::bail!(
                "{}: no hvprof frame in this file ({}): is it an hvprof serial log?",
                path.display(),
                match self.text.len() {
                    0 => "it is empty".to_owned(),
                    n => format!("{n} bytes of other text or data"),
                }
            );
        }
        Ok(())
    }

    /// [`Profile::from_capture`] of a copy of `bytes`.
    pub fn from_bytes(
        bytes: &[u8],
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        Self::from_capture(bytes.to_vec().into(), images, options, progress)
    }

    /// Decodes (on `options.threads` threads) and classifies a capture, and names its stacks.
    pub fn from_capture(
        bytes: Capture,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        Self::from_capture_with_namer(bytes, images, options, progress).0
    }

    /// [`Profile::from_capture`], and the namer that named it: the report's tables name with it
    /// what the profile leaves unnamed (`LoadOptions::report_only`).
    pub fn from_capture_with_namer<'i>(
        bytes: Capture,
        images: &'i Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> (Profile, Namer<'i>) {
        let mut warnings = Vec::new();
        let window = match options.time {
            None => Window::ALL,
            Some(range) => match crate::model::window::tsc_hz(&bytes) {
                Some(hz) => range.ticks(hz),
                None => {
                    warnings.push(format!(
                        "--time {range}: the capture has no header (no TSC frequency to read the times with): the whole capture is shown"
                    ));
                    Window::ALL
                }
            },
        };
        // Who ran (the task frames) first, from the capture's frames without its records: a
        // Linux guest's samples are classified by the task their vCPU ran, so the records are
        // read once, knowing them.
        progress.phase("reading", None, "frames");
        let meta = hvprof_samplelog::decode_metadata_parallel(&bytes, options.threads);
        let namer = Namer::new(&meta, images, &mut warnings);
        drop(meta);
        let processes = Some(namer.processes()).filter(Processes::any_linux);
        let (decoded, classified) = Classified::decode(
            &bytes,
            options.threads,
            processes.as_ref(),
            window,
            Keep {
                segments: options.tables,
                samples: options.keep_samples,
            },
            progress,
        );
        progress.phase("naming", None, "stacks");
        let Classified {
            mut samples,
            events,
            cost,
            segments,
            kept,
            blocks,
            seen,
        } = classified;
        if let Some(range) = options
            .time
            .filter(|_| samples.len == 0 && !window.is_all())
        {
            let hz = decoded.header.as_ref().map_or(0, |h| h.tsc_hz).max(1) as f64;
            warnings.push(match seen {
                Some((a, b)) => format!(
                    "--time {range}: no samples in this stretch; the capture's run from {:.6} s to {:.6} s",
                    a as f64 / hz,
                    b as f64 / hz
                ),
                None => format!("--time {range}: no samples in this stretch, nor in the capture"),
            });
        }
        let mut events = crate::model::window::clip_events(events, window);
        let replay = Replay {
            bytes,
            blocks,
            kept,
            window,
        };
        let needed = |s: &Stack| {
            !options.report_only
                || !is_guest(s.what)
                || (options.keep_guest && namer.is_linux(s.vm))
        };
        // The time axis (made before naming: it reads no name), and each vCPU's blank slots
        // on it, counted on another core while the stacks are named (neither reads what the
        // other makes).
        let axis = options.tables.then(|| replay.time_axis(segments));
        let (frames, calls, blanks) = std::thread::scope(|sc| {
            let blanks = axis.as_ref().map(|axis| {
                let (events, replay) = (&events, &replay);
                sc.spawn(move || {
                    let partial = |pcpu: u16, i: usize, lo: u64, hi: Option<u64>| {
                        replay.partial(axis, pcpu, i, lo, hi)
                    };
                    (!events.is_empty()).then(|| {
                        crate::model::timeline::segment_blanks(&axis.segments, events, &partial)
                    })
                })
            });
            let frames = samples.name(&namer, needed);
            // The report alone reads no chain.
            let calls = if options.report_only {
                Calls::default()
            } else {
                let (calls, ids) = crate::model::calls::name(&samples, &namer, needed);
                for (s, id) in samples.stacks.iter_mut().zip(ids) {
                    s.calls = id;
                }
                calls
            };
            let blanks =
                blanks.and_then(|b| b.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
            (frames, calls, blanks)
        });
        let header = decoded.header.clone().unwrap_or_default();
        if decoded.header.is_none() {
            warnings.insert(
                0,
                "no header frame: VM names and the period are unknown".into(),
            );
        }
        let hv_id = header.build_id.as_bytes().to_vec();
        let hv_matches = images
            .hypervisor
            .as_ref()
            .map(|s| s.build_id.as_deref() == Some(hv_id.as_slice()));
        if hv_matches == Some(false) {
            warnings.push(
                "the hypervisor ELF given does not have the build id in the log: its names may be wrong"
                    .into(),
            );
        }
        let lost = Lost::of(&decoded);
        if lost.truncated {
            warnings.push(
                "no end frame: the capture is truncated (losses after the last block are unknown)"
                    .into(),
            );
        }
        // What was lost and the signs of a forged log open the warnings.
        let first_tsc = (!samples.is_empty()).then(|| samples.span().0);
        let (losses, mut first_lines) = losses(&decoded, first_tsc, header.tsc_hz);
        let integrity = Integrity::of(&decoded);
        first_lines.extend(integrity.warnings());
        warnings.splice(0..0, first_lines);
        if !options.report_only {
            sort_events(&mut events);
        }
        let profile = Profile {
            tsc_hz: header.tsc_hz,
            period_ticks: header.period_ticks,
            pcpus: header.pcpus,
            vms: namer.vms.clone(),
            samples,
            frames,
            calls,
            events,
            text: decoded.text_joined(),
            vm_ends: decoded.vm_ends.clone(),
            frames_found: decoded.frames,
            source: if header.source == hvprof_samplelog::SOURCE_PMU {
                "pmu"
            } else {
                "deadline"
            },
            hypervisor_build_id: hex(&hv_id),
            hypervisor_build_id_matches: hv_matches,
            lost,
            losses,
            integrity,
            cost,
            whole_cost: crate::model::cost::from_frames(&decoded.costs, &decoded.vm_ends),
            warnings,
            time: options.time.filter(|_| !window.is_all()),
            blanks,
            replay,
        };
        (profile, namer)
    }
}

impl Profile {
    /// Reads every sample again, in TSC order (then pCPU), as the first pass kept it
    /// ([`LoadOptions::keep_samples`]; an error without): consecutive runs of them go to
    /// `work` on every core, a few runs at a time, which fills an `R` (the one a previous run
    /// filled and `consume` emptied: `work` clears it first), and `consume` gets each run's
    /// `R` in order. Memory holds a few runs besides the kept samples (and, for a pCPU whose
    /// blocks are out of TSC order, a damaged capture's, its samples sorted), and is reused
    /// from run to run.
    pub fn replay<R: Send + Default>(
        &self,
        work: impl Fn(&[Sampled], &mut R) + Sync,
        consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        self.replay.replay(&self.samples, work, consume)
    }

    /// As [`Profile::replay`], each sample as its TSC and its stack (an index into
    /// [`Samples::stacks`]) only: for a view that reads no other field, which spares the
    /// workers making each sample whole.
    pub fn replay_stacks<R: Send + Default>(
        &self,
        work: impl Fn(&[(u64, u32)], &mut R) + Sync,
        consume: impl FnMut(&mut R) -> Result<()>,
    ) -> Result<()> {
        self.replay.replay_stacks(work, consume)
    }

    /// Every sample in TSC order (then pCPU), one by one on this thread ([`Profile::replay`]).
    pub fn for_each_sample(&self, mut f: impl FnMut(&Sampled)) -> Result<()> {
        self.for_each_run(|run| run.iter().for_each(&mut f))
    }

    /// Every sample in TSC order (then pCPU), a run of them at a time on this thread (the
    /// caller may look ahead in a run, to prefetch).
    pub fn for_each_run(&self, mut f: impl FnMut(&[Sampled])) -> Result<()> {
        self.replay(
            |run, out: &mut Vec<Sampled>| {
                out.clear();
                out.extend_from_slice(run);
            },
            |run| {
                f(run);
                Ok(())
            },
        )
    }

    /// Every sample in TSC order (then pCPU), in memory (tests, small captures).
    pub fn samples_in_order(&self) -> Result<Vec<Sampled>> {
        let mut all = Vec::with_capacity(self.samples.len());
        self.for_each_sample(|s| all.push(*s))?;
        Ok(all)
    }

    /// The VM's name (`vm<N>` when the header does not list it).
    pub fn vm_name(&self, vm: u16) -> String {
        self.vms
            .iter()
            .find(|v| v.id == vm)
            .map_or_else(|| format!("vm{vm}"), |v| v.name.clone())
    }

    /// Every vCPU that has samples or events, sorted.
    pub fn vcpus(&self) -> Vec<(u16, u16)> {
        let mut v: Vec<(u16, u16)> = self
            .samples
            .stacks()
            .iter()
            .filter(|s| is_guest(s.what) && s.count > 0)
            .map(|s| (s.vm, s.vcpu))
            .chain(self.events.iter().map(|(_, e)| (e.vm, e.vcpu)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The pCPUs that have samples, sorted.
    pub fn pcpu_list(&self) -> Vec<u16> {
        self.replay.blocks.iter().map(|(c, _)| *c).collect()
    }

    /// First and last sample TSC.
    pub fn span(&self) -> (u64, u64) {
        self.samples.span()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::samples::ChainEnd;
    use crate::model::samples::Sampled;
    use crate::model::samples::What;
    use crate::model::timeline::Owner;
    use hvprof_samplelog::NO_VM;
    use hvprof_samplelog::Record;
    use hvprof_samplelog::SampleKind;
    use hvprof_samplelog::synth;
    use proptest::prelude::*;

    #[test]
    fn every_sample_is_named_and_counted_once() {
        let cfg = synth::SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 3000,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let p = Profile::from_bytes(
            &cap.bytes,
            &Images::default(),
            LoadOptions::all(2),
            &Progress::hidden(),
        );
        assert_eq!(p.samples.len() as u64, cap.samples);
        let all: Vec<Sampled> = p.samples_in_order().unwrap();
        assert_eq!(replayed(&all), decoded(&cap.bytes));
        assert!(
            all.windows(2)
                .all(|w| (w[0].tsc, w[0].pcpu) <= (w[1].tsc, w[1].pcpu))
        );
        assert!(all.iter().all(|s| (s.frame as usize) < p.frames.len()));
        // Frames are distinct.
        let set: std::collections::HashSet<_> = p.frames.iter().collect();
        assert_eq!(set.len(), p.frames.len());
        // Hypervisor frames name whom they worked for.
        for s in all.iter().filter(|s| s.what == What::Hypervisor) {
            let f = &p.frames[s.frame as usize];
            assert_eq!(f.vm, "[hypervisor]");
            if s.vm == NO_VM {
                assert_eq!(f.process, "no VM");
            } else {
                assert!(f.process.starts_with(&p.vm_name(s.vm)), "{}", f.process);
            }
        }
    }

    #[test]
    fn chains_are_kept_with_their_samples_counted_once_and_read_again() {
        use std::collections::HashMap as Map;
        let cfg = synth::SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 3000,
            chains: true,
            ..synth::SynthConfig::default()
        };
        let cap = synth::capture(&cfg, &synth::CaptureOptions::default());
        let load = |threads| {
            Profile::from_bytes(
                &cap.bytes,
                &Images::default(),
                LoadOptions::all(threads),
                &Progress::hidden(),
            )
        };
        let (one, three) = (load(1), load(3));
        assert!(one.samples.has_chains());
        assert_eq!(one.samples.len() as u64, cap.samples);
        // Kept by the first pass on one thread and on three (each thread's keys numbered in
        // the first one's table), every sample is read again, in the same order.
        let all = three.samples_in_order().unwrap();
        assert_eq!(replayed(&all), decoded(&cap.bytes));
        assert_eq!(one.samples_in_order().unwrap(), all);
        // Each stack's chains are its samples': counted per (kind, VM, address, chains) from
        // the decoder's records and frames.
        type ChainKey = (bool, u16, u64, Vec<u64>, ChainEnd, Vec<u64>, ChainEnd);
        let mut want: Map<ChainKey, u64> = Map::new();
        let d = hvprof_samplelog::decode(&cap.bytes);
        for log in d.pcpus.values() {
            for (s, c) in log.samples_with_chains() {
                let hv = s.kind != SampleKind::Guest;
                let addr = if hv { s.host_rip } else { s.guest_rip };
                let key = (
                    hv,
                    s.vm,
                    addr,
                    c.host.to_vec(),
                    s.host_chain.end(),
                    c.guest.to_vec(),
                    s.guest_chain.end(),
                );
                *want.entry(key).or_default() += 1;
            }
        }
        let mut got: Map<ChainKey, u64> = Map::new();
        for st in three.samples.stacks() {
            let hv = !is_guest(st.what);
            let key = match three.samples.chain(st.chain) {
                Some(c) => (
                    hv,
                    st.vm,
                    st.addr,
                    c.host.to_vec(),
                    c.host_end,
                    c.guest.to_vec(),
                    c.guest_end,
                ),
                None => (
                    hv,
                    st.vm,
                    st.addr,
                    Vec::new(),
                    ChainEnd::NotWalked,
                    Vec::new(),
                    ChainEnd::NotWalked,
                ),
            };
            *got.entry(key).or_default() += st.count;
        }
        assert_eq!(got, want);
        // Exit causes keep their vCPU's guest context.
        assert!(
            three
                .samples
                .stacks()
                .iter()
                .any(|s| s.exit_cause && s.process.is_some() && s.calls != 0)
        );
    }

    #[test]
    fn a_block_longer_than_32_bits_of_ticks_keeps_its_tscs_whole() {
        use hvprof_samplelog::Sample;
        // Ten samples a block; 2^33 ticks between the 15th and 16th, so inside the second.
        let records: Vec<Record> = (0..30u64)
            .map(|i| {
                Record::Sample(Sample {
                    kind: SampleKind::Hypervisor,
                    host_rip: 0x2000 + i % 3,
                    tsc: 1000 * i + if i >= 15 { 1 << 33 } else { 0 },
                    ..Sample::default()
                })
            })
            .collect();
        let bytes = hvprof_samplelog::synth::encode_blocks(0, &records, 10, 10);
        let load = |keep_samples| {
            Profile::from_bytes(
                &bytes,
                &Images::default(),
                LoadOptions {
                    keep_samples,
                    ..LoadOptions::all(1)
                },
                &Progress::hidden(),
            )
        };
        let kept = load(true);
        let wide: Vec<Option<bool>> = kept.replay.blocks[0]
            .1
            .iter()
            .map(|b| b.kept.map(|k| k.wide))
            .collect();
        assert_eq!(wide, [Some(false), Some(true), Some(false)]);
        let all = kept.samples_in_order().unwrap();
        assert_eq!(all.len(), 30);
        assert_eq!(replayed(&all), decoded(&bytes));
        // Not kept, the samples cannot be read again.
        assert!(load(false).samples_in_order().is_err());
    }

    /// Every sample of a capture as the decoder gives it (TSC, pCPU, VM, vCPU, address, a
    /// guest's or not), sorted.
    fn decoded(bytes: &[u8]) -> Vec<(u64, u16, u16, u16, u64, bool)> {
        let d = hvprof_samplelog::decode(bytes);
        let mut all: Vec<_> = d
            .pcpus
            .iter()
            .flat_map(|(&pcpu, log)| {
                log.samples().map(move |s| {
                    let guest = s.kind == SampleKind::Guest;
                    let addr = if guest { s.guest_rip } else { s.host_rip };
                    (s.tsc, pcpu, s.vm, s.vcpu, addr, guest)
                })
            })
            .collect();
        all.sort_unstable();
        all
    }

    /// The samples read again, as [`decoded`] gives them.
    fn replayed(all: &[Sampled]) -> Vec<(u64, u16, u16, u16, u64, bool)> {
        let mut out: Vec<_> = all
            .iter()
            .map(|s| (s.tsc, s.pcpu, s.vm, s.vcpu, s.addr, is_guest(s.what)))
            .collect();
        out.sort_unstable();
        out
    }

    /// Random records on a few pCPUs: samples of a few owners in runs (as a pCPU's samples
    /// come), scheduling events, TSCs rising (or not).
    fn arb_pcpu_records() -> impl Strategy<Value = Vec<Record>> {
        use hvprof_samplelog::{Event, EventKind, OutReason, Sample, guest_mode};
        let vm = prop_oneof![Just(0u16), Just(1), Just(NO_VM)];
        let sample = (0u8..3, vm.clone(), 0u16..3, 1usize..6, 0u64..3).prop_map(
            |(kind, vm, vcpu, n, rip)| {
                let s = Sample {
                    kind: SampleKind::from_u8(kind).unwrap_or_default(),
                    vm,
                    vcpu,
                    guest_mode: guest_mode(0, 2),
                    guest_rip: 0x1000 + rip,
                    host_rip: 0x2000 + rip,
                    ..Sample::default()
                };
                vec![Record::Sample(s); n]
            },
        );
        let event = (any::<bool>(), vm, 0u16..3, 0u8..4).prop_map(|(out, vm, vcpu, reason)| {
            vec![Record::Event(Event {
                kind: if out {
                    EventKind::VcpuOut
                } else {
                    EventKind::VcpuIn
                },
                vm,
                vcpu,
                reason: OutReason::from_u8(reason).unwrap_or_default(),
                tsc: 0,
            })]
        });
        prop::collection::vec((0u64..30, prop_oneof![2 => sample, 1 => event]), 0..40).prop_map(
            |groups| {
                let mut t = 0u64;
                let mut out = Vec::new();
                for (dt, group) in groups {
                    for mut r in group {
                        t += dt / 4;
                        match &mut r {
                            Record::Sample(s) => s.tsc = t,
                            Record::Event(e) => e.tsc = t,
                        }
                        out.push(r);
                    }
                }
                out
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// What the report counts per segment, reading samples again from the blocks where an
        /// event falls inside a segment (and from sorted lists for a pCPU whose blocks came out
        /// of TSC order), is what counting every sample gives; the samples read again are every
        /// sample, in TSC order.
        #[test]
        fn segments_and_replay_agree_with_every_sample(
            pcpus in prop::collection::vec(arb_pcpu_records(), 1..4),
            block_records in 1usize..9,
            swap in any::<bool>(),
        ) {
            let mut bytes = Vec::new();
            for (pcpu, r) in pcpus.iter().enumerate() {
                let stream = hvprof_samplelog::synth::encode_blocks(pcpu as u16, r, 10, block_records);
                // Its frames (each `0x00 COBS 0x00`), the first two sent in the other order
                // (their numbers tell the decoder; their TSCs go back).
                let mut frames: Vec<&[u8]> = stream
                    .split(|&b| b == 0)
                    .filter(|f| !f.is_empty())
                    .collect();
                if swap && frames.len() > 1 {
                    frames.swap(0, 1);
                }
                for f in frames {
                    bytes.push(0);
                    bytes.extend_from_slice(f);
                    bytes.push(0);
                }
            }
            let p = Profile::from_bytes(
                &bytes,
                &Images::default(),
                LoadOptions::all(2),
                &Progress::hidden(),
            );
            let all = p.samples_in_order().unwrap();
            prop_assert_eq!(replayed(&all), decoded(&bytes));
            prop_assert!(all.windows(2).all(|w| (w[0].tsc, w[0].pcpu) <= (w[1].tsc, w[1].pcpu)));
            let mut lists: HashMap<u16, Vec<(u64, Owner)>> = HashMap::default();
            for s in &all {
                lists.entry(s.pcpu).or_default().push((s.tsc, s.owner()));
            }
            for l in lists.values_mut() {
                l.sort_by_key(|s| s.0);
            }
            let want = crate::model::timeline::blanks(&lists, &p.events);
            let classified =
                Classified::decode(&bytes, 2, None, Window::ALL, Keep { segments: true, samples: false }, &Progress::hidden()).1;
            let axis = p.replay.time_axis(classified.segments);
            let partial = |pcpu: u16, i: usize, lo: u64, hi: Option<u64>| {
                p.replay.partial(&axis, pcpu, i, lo, hi)
            };
            let got = crate::model::timeline::segment_blanks(&axis.segments, &p.events, &partial);
            prop_assert_eq!(got, want);
        }
    }
}
