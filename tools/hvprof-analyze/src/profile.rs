//! Every sample of a capture, named: the model the charts and the export formats are drawn from,
//! with the report built from the same decoding (so their totals agree by construction).
//!
//! A sample's frame is four names, outermost first: the VM, the process, the module, the
//! function. Guest samples: `guestOS1; cr3:0x1000 (or comm[tgid]); mix1.elf; work_a`.
//! Hypervisor samples: `[hypervisor]; <VM>: <exit reason> (or "no VM"); hvprof; <function>`.
//! Idle samples: `[idle]` alone.

use anyhow::{Context, Result};
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{Decoded, Event, NO_VM, Record, SampleKind};

use crate::naming::{Namer, ProcessKey, VmMeta, exit_name};
use crate::progress::Progress;
use crate::report::{Aggregate, Images, Report};
use crate::timeline::Owner;

/// What a pCPU was doing at a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum What {
    GuestKernel,
    GuestUser,
    Hypervisor,
    Idle,
}

/// One sample, compact (10 M samples fit in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    pub tsc: u64,
    /// The guest CR3 (guest samples).
    pub cr3: u64,
    /// The sampled address: guest RIP, or hypervisor RIP.
    pub addr: u64,
    /// Index into `Profile::frames`.
    pub frame: u32,
    pub pcpu: u16,
    /// `NO_VM` for the hypervisor's work for no VM, and idle.
    pub vm: u16,
    pub vcpu: u16,
    /// The vCPU's last exit reason (`NO_EXIT` when none).
    pub exit: u16,
    pub what: What,
}

impl Sampled {
    pub fn owner(&self) -> Owner {
        match self.what {
            What::GuestKernel | What::GuestUser => Owner::Guest {
                vm: self.vm,
                vcpu: self.vcpu,
            },
            What::Hypervisor => Owner::Hypervisor {
                vm: self.vm,
                vcpu: self.vcpu,
            },
            What::Idle => Owner::Idle,
        }
    }
}

/// A named frame: VM, process, module, function (outermost first).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    pub what: What,
    pub vm: String,
    pub process: String,
    pub module: String,
    pub function: String,
    /// The guest process's identity, for labels (guest frames).
    pub process_key: Option<ProcessKey>,
}

/// The label of the hypervisor's "process" frame: whom it worked for, and on which exit.
pub fn hypervisor_label(vm_name: Option<&str>, exit: u16) -> String {
    match vm_name {
        None => "no VM".to_owned(),
        Some(name) => format!("{name}: {}", exit_name(exit)),
    }
}

impl Frame {
    /// The frame's names, outermost first, without the empty ones.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        [
            self.vm.as_str(),
            self.process.as_str(),
            self.module.as_str(),
            self.function.as_str(),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
    }

    /// The folded stack (`VM;process;module;function`), with `;` in names made `,` (Rust generic
    /// arrays `[u8; 4]` would split a frame).
    pub fn folded(&self) -> String {
        self.names()
            .map(|n| n.replace(';', ","))
            .collect::<Vec<_>>()
            .join(";")
    }
}

/// A whole capture, named.
pub struct Profile {
    pub report: Report,
    pub tsc_hz: u64,
    pub period_ticks: u64,
    pub pcpus: u16,
    pub vms: Vec<VmMeta>,
    /// Every sample, in TSC order (then pCPU).
    pub samples: Vec<Sampled>,
    pub frames: Vec<Frame>,
    /// Every scheduling event with its pCPU, in TSC order.
    pub events: Vec<(u16, Event)>,
    /// The console text of the capture (shown, never read for data).
    pub text: String,
    /// The VM end frames: exit tables, LSTAR, task offsets.
    pub vm_ends: Vec<hvprof_samplelog::VmEnd>,
}

/// The report's flags: `keep_guest` names Linux guests' samples by process (`--kernel`,
/// `--processes`).
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub threads: usize,
    pub keep_guest: bool,
}

/// A sample as decoded, before naming.
#[derive(Clone, Copy)]
struct Raw {
    tsc: u64,
    cr3: u64,
    addr: u64,
    pcpu: u16,
    vm: u16,
    vcpu: u16,
    exit: u16,
    what: What,
}

struct Acc {
    agg: Aggregate,
    raw: Vec<Raw>,
}

impl Profile {
    /// Reads and names a capture file.
    pub fn load(
        path: &std::path::Path,
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Result<Profile> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let profile = Self::from_bytes(&bytes, images, options, progress);
        if profile.samples.is_empty() {
            anyhow::bail!(
                "{}: no samples in this capture ({} bytes{}): is it an hvprof serial log?",
                path.display(),
                bytes.len(),
                if profile.report.lost.truncated {
                    ", no end frame"
                } else {
                    ""
                }
            );
        }
        Ok(profile)
    }

    /// Decodes (on `options.threads` threads), reports and names a capture.
    pub fn from_bytes(
        bytes: &[u8],
        images: &Images,
        options: LoadOptions,
        progress: &Progress,
    ) -> Profile {
        progress.phase("decoding", None, "records");
        let init = || Acc {
            agg: if options.keep_guest {
                Aggregate::keeping_guest_samples()
            } else {
                Aggregate::new()
            },
            raw: Vec::new(),
        };
        let (decoded, parts) = hvprof_samplelog::decode_parallel(
            bytes,
            options.threads,
            init,
            |acc: &mut Acc, pcpu, records: &[Record]| {
                acc.agg.add(pcpu, records);
                acc.raw.extend(records.iter().filter_map(|r| {
                    let s = r.as_sample()?;
                    let (what, addr) = match s.kind {
                        SampleKind::Guest if s.cpl() == 3 => (What::GuestUser, s.guest_rip),
                        SampleKind::Guest => (What::GuestKernel, s.guest_rip),
                        SampleKind::Hypervisor => (What::Hypervisor, s.host_rip),
                        SampleKind::Idle => (What::Idle, s.host_rip),
                    };
                    Some(Raw {
                        tsc: s.tsc,
                        cr3: s.guest_cr3,
                        addr,
                        pcpu,
                        vm: s.vm,
                        vcpu: s.vcpu,
                        exit: s.exit_reason,
                        what,
                    })
                }));
                progress.inc(records.len() as u64);
            },
        );
        let mut agg = init().agg;
        let mut raw = Vec::new();
        for p in parts {
            agg.merge(p.agg);
            raw.extend(p.raw);
        }
        let mut events = agg.sched.clone();
        events.sort_by_key(|(pcpu, e)| (e.tsc, *pcpu));
        let report = crate::report::build_from(&decoded, agg, images);
        Self::name(&decoded, report, raw, events, images, progress)
    }

    fn name(
        decoded: &Decoded,
        report: Report,
        mut raw: Vec<Raw>,
        events: Vec<(u16, Event)>,
        images: &Images,
        progress: &Progress,
    ) -> Profile {
        raw.sort_by_key(|r| (r.tsc, r.pcpu));
        progress.phase("naming", Some(raw.len() as u64), "samples");
        let mut ignored = Vec::new();
        let namer = Namer::new(decoded, images, &mut ignored);
        let mut frames: Vec<Frame> = Vec::new();
        let mut index: HashMap<Frame, u32> = HashMap::default();
        // (what, vm, exit, address, process) → frame.
        type Key = (What, u16, u16, u64, Option<ProcessKey>);
        let mut cache: HashMap<Key, u32> = HashMap::default();
        let mut samples = Vec::with_capacity(raw.len());
        for (i, r) in raw.iter().enumerate() {
            let key: Key = match r.what {
                What::GuestKernel | What::GuestUser => (
                    r.what,
                    r.vm,
                    0,
                    r.addr,
                    Some(namer.process_key(r.vm, r.vcpu, r.tsc, r.cr3)),
                ),
                What::Hypervisor => (r.what, r.vm, r.exit, r.addr, None),
                What::Idle => (r.what, 0, 0, 0, None),
            };
            let frame = *cache.entry(key).or_insert_with(|| {
                let f = make_frame(&namer, r, key.4);
                *index.entry(f.clone()).or_insert_with(|| {
                    frames.push(f);
                    (frames.len() - 1) as u32
                })
            });
            samples.push(Sampled {
                tsc: r.tsc,
                cr3: r.cr3,
                addr: r.addr,
                frame,
                pcpu: r.pcpu,
                vm: r.vm,
                vcpu: r.vcpu,
                exit: r.exit,
                what: r.what,
            });
            if i % 65536 == 65535 {
                progress.inc(65536);
            }
        }
        let header = decoded.header.clone().unwrap_or_default();
        Profile {
            report,
            tsc_hz: header.tsc_hz,
            period_ticks: header.period_ticks,
            pcpus: header.pcpus,
            vms: namer.vms.clone(),
            samples,
            frames,
            events,
            text: decoded.text_joined(),
            vm_ends: decoded.vm_ends.clone(),
        }
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
            .iter()
            .filter(|s| matches!(s.what, What::GuestKernel | What::GuestUser))
            .map(|s| (s.vm, s.vcpu))
            .chain(self.events.iter().map(|(_, e)| (e.vm, e.vcpu)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The pCPUs that have samples, sorted.
    pub fn pcpu_list(&self) -> Vec<u16> {
        let mut v: Vec<u16> = self.samples.iter().map(|s| s.pcpu).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// First and last sample TSC.
    pub fn span(&self) -> (u64, u64) {
        (
            self.samples.first().map_or(0, |s| s.tsc),
            self.samples.last().map_or(0, |s| s.tsc),
        )
    }

    /// Seconds since the first sample.
    pub fn seconds(&self, tsc: u64) -> f64 {
        let hz = if self.tsc_hz == 0 {
            1e9
        } else {
            self.tsc_hz as f64
        };
        tsc.saturating_sub(self.span().0) as f64 / hz
    }

    /// Nanoseconds of `ticks` TSC ticks (ticks when the TSC frequency is unknown).
    pub fn ticks_to_ns(&self, ticks: u64) -> u64 {
        if self.tsc_hz == 0 {
            ticks
        } else {
            (u128::from(ticks) * 1_000_000_000 / u128::from(self.tsc_hz)) as u64
        }
    }
}

fn make_frame(namer: &Namer, r: &Raw, process: Option<ProcessKey>) -> Frame {
    match r.what {
        What::GuestKernel | What::GuestUser => {
            let label = process.map(|p| namer.process(p));
            let task = namer.task(r.vm, r.vcpu, r.tsc);
            let (function, module) =
                namer.guest_function(r.vm, r.what == What::GuestUser, r.addr, task);
            Frame {
                what: r.what,
                vm: namer.vm_name(r.vm),
                process: label.unwrap_or_default(),
                module,
                function,
                process_key: process,
            }
        }
        What::Hypervisor => Frame {
            what: r.what,
            vm: "[hypervisor]".into(),
            process: hypervisor_label(
                (r.vm != NO_VM).then(|| namer.vm_name(r.vm)).as_deref(),
                r.exit,
            ),
            module: "hvprof".into(),
            function: namer.hypervisor_function(r.addr),
            process_key: None,
        },
        What::Idle => Frame {
            what: r.what,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: "[idle]".into(),
            process_key: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvprof_samplelog::synth;

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
            LoadOptions {
                threads: 2,
                keep_guest: false,
            },
            &Progress::hidden(),
        );
        assert_eq!(p.samples.len() as u64, p.report.total_samples);
        assert_eq!(p.report.total_samples, cap.samples);
        assert!(p.samples.windows(2).all(|w| w[0].tsc <= w[1].tsc));
        assert!(
            p.samples
                .iter()
                .all(|s| (s.frame as usize) < p.frames.len())
        );
        // Frames are distinct.
        let set: std::collections::HashSet<_> = p.frames.iter().collect();
        assert_eq!(set.len(), p.frames.len());
        // Hypervisor frames name whom they worked for.
        for s in p.samples.iter().filter(|s| s.what == What::Hypervisor) {
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
    fn folded_frames_never_split_on_semicolons() {
        let f = Frame {
            what: What::Hypervisor,
            vm: "[hypervisor]".into(),
            process: "no VM".into(),
            module: "hvprof".into(),
            function: "<[u8; 4] as Foo>::bar".into(),
            process_key: None,
        };
        assert_eq!(
            f.folded(),
            "[hypervisor];no VM;hvprof;<[u8, 4] as Foo>::bar"
        );
        let idle = Frame {
            what: What::Idle,
            vm: String::new(),
            process: String::new(),
            module: String::new(),
            function: "[idle]".into(),
            process_key: None,
        };
        assert_eq!(idle.folded(), "[idle]");
    }
}
