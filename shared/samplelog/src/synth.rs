//! Synthetic, realistic sample traces (feature `std`), for tests and benchmarks.
//!
//! The model (fixed, so that measured sizes mean something; see [`SynthConfig`] for the knobs):
//! - three VMs: two 2-vCPU Linux guests (64-bit, processes with their own CR3, user and kernel
//!   halves) and a 1-vCPU 32-bit kernel-only RTOS; vCPUs are placed round-robin on the pCPUs, so
//!   some pCPUs time-share two vCPUs (20 ms slices: steal) and vCPUs halt and wake (idle, halt);
//! - a sample every `tsc_hz / sample_hz` ticks on an absolute deadline grid, taken late by
//!   900 + 0..232 ticks in the guest (preemption-timer exit, 32-tick granularity), 1500 + 0..1200
//!   in the hypervisor (LAPIC timer), 3000 + 0..2400 in idle (HLT wake-up), plus up to 28 k ticks
//!   for 2 % of samples (interrupts masked);
//! - guest RIPs in a dozen functions per address space, Zipf(1.5)-weighted (the top four take
//!   ~75 %), 75 % of them on 2–6 hot instructions per function, the rest anywhere in the function
//!   (64 B – 8 KiB); 60 % of samples stay in the previous sample's function; the guest is in its
//!   kernel ~15 % of the time; processes switch every ~50 samples;
//! - the last exit reason changes on ~25 % of samples; 3 % of samples land in the hypervisor;
//! - the sample path costs ~1.5 k ticks ± 64, with 1 % outliers up to +8 k;
//! - `ring_drop_rate` of the samples are lost to a full ring (counted, not recorded);
//! - with `chains` (off by default: the default trace is the same byte for byte), samples carry
//!   call chains from a fixed caller tree per address space: function `i > 0` is called from
//!   function `(i - 1) / 2`, or (for `i >= 3`, on every other 32-tick TSC slot) from the one
//!   before it, at a fixed call site, up to function 0; guest samples carry their guest chain,
//!   hypervisor samples their host chain and the vCPU's exit cause (its RIP, then its callers),
//!   idle samples one host frame; one sample in 64 (by TSC) ends at a bad frame after its first
//!   frame. The chains draw nothing from the generator's random numbers.

#![allow(
    clippy::cast_possible_truncation,
    reason = "a test-trace generator, not a codec: its random draws are bounded below their target types"
)]

use std::collections::VecDeque;
use std::ops::Range;

use crate::encode::{BlockEncoder, encode_end, encode_header, max_block_frame_len};
use crate::types::{
    BlockHeader, BuildId, Chain, ChainEnd, Event, EventKind, FixedStr, Header, MODE_LONG,
    MODE_PROTECTED, NO_EXIT, NO_VCPU, NO_VM, OutReason, PcpuTotals, Record, SOURCE_DEADLINE,
    Sample, SampleKind, VmInfo, guest_mode,
};
use crate::{MAX_END_PCPUS, MAX_HEADER_FRAME_LEN, max_end_frame_len};

/// A small deterministic PRNG (SplitMix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `r`.
    pub fn range(&mut self, r: Range<u64>) -> u64 {
        r.start + self.below(r.end - r.start)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64) < p * (1u64 << 53) as f64
    }
}

/// Knobs of the synthetic trace.
#[derive(Clone, Debug)]
pub struct SynthConfig {
    /// PRNG seed.
    pub seed: u64,
    /// Number of pCPUs.
    pub pcpus: u16,
    /// Samples each pCPU takes (recorded + ring drops).
    pub samples_per_pcpu: u64,
    /// TSC frequency.
    pub tsc_hz: u64,
    /// Sampling frequency.
    pub sample_hz: u64,
    /// Fraction of samples lost to a full ring.
    pub ring_drop_rate: f64,
    /// Give samples call chains (see the module documentation).
    pub chains: bool,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            pcpus: 4,
            samples_per_pcpu: 25_000,
            tsc_hz: 2_400_000_000,
            sample_hz: 1000,
            ring_drop_rate: 0.0005,
            chains: false,
        }
    }
}

impl SynthConfig {
    /// Nominal period in TSC ticks.
    #[must_use]
    pub fn period_ticks(&self) -> u64 {
        self.tsc_hz / self.sample_hz.max(1)
    }
}

/// Cumulative Zipf(`s`) weights over `n` items, scaled to 2^32.
fn zipf_table(n: usize, s: f64) -> Vec<u64> {
    let w: Vec<f64> = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x;
            ((acc / total) * 4_294_967_296.0) as u64
        })
        .collect()
}

fn zipf_pick(rng: &mut Rng, table: &[u64]) -> usize {
    let x = rng.below(1 << 32);
    table.iter().position(|&c| x < c).unwrap_or(table.len() - 1)
}

#[derive(Clone, Debug)]
struct Func {
    start: u64,
    len: u64,
    hot: Vec<u64>,
    hot_zipf: Vec<u64>,
}

impl Func {
    fn random(rng: &mut Rng, start: u64) -> Self {
        // Log-uniform length 64 B .. 4 KiB.
        let len = 64u64 << rng.below(7);
        let len = len + rng.below(len);
        let n = 2 + rng.below(5) as usize;
        let hot = (0..n).map(|_| rng.below(len)).collect();
        Self {
            start,
            len,
            hot,
            hot_zipf: zipf_table(n, 1.1),
        }
    }

    fn rip(&self, rng: &mut Rng) -> u64 {
        if rng.chance(0.75) {
            self.start + self.hot[zipf_pick(rng, &self.hot_zipf)]
        } else {
            self.start + rng.below(self.len)
        }
    }
}

#[derive(Clone, Debug)]
struct Space {
    cr3: u64,
    funcs: Vec<Func>,
    zipf: Vec<u64>,
}

impl Space {
    /// The call chain of function `f` (innermost first: the return addresses in its callers,
    /// up to function 0) into `out`; `tsc` picks between the two callers of those that have
    /// two. One sample in 64 (by `tsc`) ends at a bad frame after its first frame.
    fn chain(&self, f: usize, tsc: u64, out: &mut Vec<u64>) -> Chain {
        let mut f = f.min(self.funcs.len().saturating_sub(1));
        while f > 0 && out.len() < crate::MAX_CHAIN_DEPTH {
            let mut caller = (f - 1) / 2;
            if f >= 3 && (tsc >> 5) & 1 == 1 {
                caller = f - 1;
            }
            // A fixed call site in the caller: its return address, inside the caller.
            let c = &self.funcs[caller];
            let site = 1 + (f as u64 * 37 + 16) % c.len.max(2).saturating_sub(1);
            out.push(c.start + site);
            if (tsc >> 7).is_multiple_of(64) {
                return Chain::new(out.len(), ChainEnd::BadFrame);
            }
            f = caller;
        }
        Chain::new(out.len(), ChainEnd::Complete)
    }

    /// The function holding `rip` (the last starting at or before it).
    fn function_at(&self, rip: u64) -> usize {
        self.funcs
            .partition_point(|f| f.start <= rip)
            .saturating_sub(1)
    }

    fn random(rng: &mut Rng, cr3: u64, text: u64, span: u64, n: usize) -> Self {
        let mut starts: Vec<u64> = (0..n).map(|_| text + (rng.below(span) & !0xf)).collect();
        starts.sort_unstable();
        Self {
            cr3,
            funcs: starts.into_iter().map(|s| Func::random(rng, s)).collect(),
            zipf: zipf_table(n, 1.5),
        }
    }
}

#[derive(Clone, Debug)]
struct VcpuSim {
    vm: u16,
    vcpu: u16,
    vpid: u16,
    long_mode: bool,
    procs: Vec<Space>,
    kernel: Space,
    cur_proc: usize,
    in_kernel: bool,
    cur_func: usize,
    rip: u64,
    exit_reason: u16,
    /// Halted until this TSC (0: runnable).
    halted_until: u64,
    halt_rate: f64,
}

/// Exit reasons a vCPU's last exit takes, weighted: external interrupt, preemption timer, I/O,
/// EPT violation, HLT, CPUID, MSR write, APIC access.
const EXIT_REASONS: [(u16, u32); 8] = [
    (1, 40),
    (52, 30),
    (30, 10),
    (48, 8),
    (12, 5),
    (10, 3),
    (32, 2),
    (44, 2),
];

fn random_exit(rng: &mut Rng) -> u16 {
    let total: u32 = EXIT_REASONS.iter().map(|e| e.1).sum();
    let mut x = rng.below(u64::from(total)) as u32;
    for (r, w) in EXIT_REASONS {
        if x < w {
            return r;
        }
        x -= w;
    }
    1
}

impl VcpuSim {
    fn current_space(&self) -> &Space {
        if self.in_kernel || self.procs.is_empty() {
            &self.kernel
        } else {
            &self.procs[self.cur_proc]
        }
    }

    /// Advances the guest by one sampling period and returns the guest sample fields.
    fn step(&mut self, rng: &mut Rng) {
        if !self.procs.is_empty() {
            if rng.chance(0.02) {
                self.cur_proc = rng.below(self.procs.len() as u64) as usize;
                self.in_kernel = false;
                self.cur_func = zipf_pick(rng, &self.procs[self.cur_proc].zipf);
            }
            let toggle = if self.in_kernel { 0.5 } else { 0.09 };
            if rng.chance(toggle) {
                self.in_kernel = !self.in_kernel;
                self.cur_func = zipf_pick(rng, &self.current_space().zipf);
            }
        }
        if rng.chance(0.4) {
            let n = self.current_space().zipf.clone();
            self.cur_func = zipf_pick(rng, &n);
        }
        let space = self.current_space();
        let f = &space.funcs[self.cur_func.min(space.funcs.len() - 1)];
        self.rip = f.rip(rng);
        if rng.chance(0.25) {
            self.exit_reason = random_exit(rng);
        }
    }

    /// The guest chain of a sample at `tsc` into `out`: the callers of the current function;
    /// with `exit`, first the RIP (the exit cause of a hypervisor sample).
    fn guest_chain(&self, tsc: u64, exit: bool, out: &mut Vec<u64>) -> Chain {
        let space = self.current_space();
        let start = out.len();
        if exit {
            out.push(self.rip);
        }
        let mut chain = Vec::new();
        let c = space.chain(space.function_at(self.rip), tsc, &mut chain);
        let room = crate::MAX_CHAIN_DEPTH - (out.len() - start);
        out.extend(chain.iter().take(room));
        let end = if chain.len() > room {
            ChainEnd::DepthLimit
        } else {
            c.end()
        };
        Chain::new(out.len() - start, end)
    }

    fn sample(&self, tsc: u64, kind: SampleKind, host_rip: u64, cost: u32) -> Sample {
        let cpl = if self.in_kernel || self.procs.is_empty() {
            0
        } else {
            3
        };
        let mode = if self.long_mode {
            MODE_LONG
        } else {
            MODE_PROTECTED
        };
        Sample {
            tsc,
            kind,
            vm: self.vm,
            vcpu: self.vcpu,
            vpid: self.vpid,
            guest_rip: self.rip,
            // Kernel mode keeps the interrupted process's address space.
            guest_cr3: self
                .procs
                .get(self.cur_proc)
                .map_or(self.kernel.cr3, |p| p.cr3),
            guest_mode: guest_mode(cpl, mode),
            exit_reason: self.exit_reason,
            host_rip,
            cost,
            ..Sample::default()
        }
    }
}

/// The VMs of the model: (name, image, vCPUs, Linux?).
const VMS: [(&str, &str, u16, bool); 3] = [
    ("web", "bzImage-6.6", 2, true),
    ("db", "bzImage-6.6", 2, true),
    ("rtos", "rtos.elf", 1, false),
];

struct PcpuSim {
    pcpu: u16,
    rng: Rng,
    period: u64,
    deadline: u64,
    last_sample_tsc: u64,
    vcpus: Vec<VcpuSim>,
    current: Option<usize>,
    slice_end: u64,
    cost_base: u32,
    hv: Space,
    idle_rip: u64,
    samples_left: u64,
    ring_drops: u64,
    drop_rate: f64,
    pending: VecDeque<Record>,
    /// With chains: each pending sample's frames (host then guest), in order.
    pending_frames: VecDeque<Vec<u64>>,
    chains: bool,
}

impl PcpuSim {
    fn event(&mut self, tsc: u64, kind: EventKind, v: usize, reason: OutReason) {
        let (vm, vcpu) = (self.vcpus[v].vm, self.vcpus[v].vcpu);
        self.pending.push_back(Record::Event(Event {
            tsc,
            kind,
            vm,
            vcpu,
            reason,
        }));
    }

    /// Produces the next sample (and the events before it) into `pending`; false when done.
    fn step(&mut self) -> bool {
        if self.samples_left == 0 {
            return false;
        }
        self.samples_left -= 1;
        let t = self.deadline;
        self.deadline += self.period;
        let slice = 20 * self.period;
        // Scheduling between the previous sample and this one.
        let mut ev_tsc = self.last_sample_tsc + self.period / 3 + self.rng.below(self.period / 3);
        if let Some(c) = self.current {
            if self.rng.chance(self.vcpus[c].halt_rate) {
                let sleep = self.period * self.rng.range(2..40);
                self.vcpus[c].halted_until = t + sleep;
                self.vcpus[c].exit_reason = 12;
                self.event(ev_tsc, EventKind::VcpuOut, c, OutReason::Halted);
                self.current = None;
                ev_tsc += 3000 + self.rng.below(1000);
            } else if t >= self.slice_end {
                let other =
                    (0..self.vcpus.len()).find(|&i| i != c && self.vcpus[i].halted_until <= t);
                if let Some(o) = other {
                    self.event(ev_tsc, EventKind::VcpuOut, c, OutReason::Preempted);
                    ev_tsc += 3000 + self.rng.below(1000);
                    self.event(ev_tsc, EventKind::VcpuIn, o, OutReason::Preempted);
                    self.current = Some(o);
                }
                self.slice_end = t + slice;
            }
        }
        if self.current.is_none() {
            let next = (0..self.vcpus.len()).find(|&i| self.vcpus[i].halted_until <= t);
            if let Some(n) = next {
                self.vcpus[n].halted_until = 0;
                self.event(ev_tsc, EventKind::VcpuIn, n, OutReason::Preempted);
                self.current = Some(n);
                self.slice_end = t + slice;
            }
        }
        // The sample, taken late by the exit/interrupt latency: a VMX-preemption-timer exit in
        // the guest (32-tick timer granularity), a LAPIC timer interrupt in the hypervisor, a
        // wake-up from HLT in idle; 2 % of samples are delayed by masked interrupts.
        let in_hv = self.current.is_some() && self.rng.chance(0.03);
        let late = match self.current {
            Some(_) if !in_hv => 900 + self.rng.below(32) + self.rng.below(200),
            Some(_) => 1500 + self.rng.below(1200),
            None => 3000 + self.rng.below(2400),
        };
        let late = late
            + if self.rng.chance(0.02) {
                self.rng.below(28_000)
            } else {
                0
            };
        let tsc = t + late;
        self.last_sample_tsc = tsc;
        let spike = if self.rng.chance(0.01) {
            self.rng.below(8000) as u32
        } else {
            0
        };
        let cost = self.cost_base + self.rng.below(64) as u32 + spike;
        let mut frames = Vec::new();
        let sample = match self.current {
            Some(c) => {
                if in_hv {
                    let f = zipf_pick(&mut self.rng, &self.hv.zipf);
                    let host_rip = self.hv.funcs[f].rip(&mut self.rng);
                    let mut s =
                        self.vcpus[c].sample(tsc, SampleKind::Hypervisor, host_rip, cost - 500);
                    if self.chains {
                        s.host_chain = self.hv.chain(f, tsc, &mut frames);
                        s.guest_chain = self.vcpus[c].guest_chain(tsc, true, &mut frames);
                    }
                    s
                } else {
                    self.vcpus[c].step(&mut self.rng);
                    let mut s = self.vcpus[c].sample(tsc, SampleKind::Guest, 0, cost);
                    if self.chains {
                        s.guest_chain = self.vcpus[c].guest_chain(tsc, false, &mut frames);
                    }
                    s
                }
            }
            None => Sample {
                tsc,
                kind: SampleKind::Idle,
                vm: NO_VM,
                vcpu: NO_VCPU,
                vpid: 0,
                guest_rip: 0,
                guest_cr3: 0,
                guest_mode: 0,
                exit_reason: NO_EXIT,
                host_rip: self.idle_rip,
                cost: cost - 700,
                host_chain: if self.chains {
                    frames.push(self.hv.funcs[0].start + 0x21);
                    Chain::new(1, ChainEnd::Complete)
                } else {
                    Chain::NOT_WALKED
                },
                ..Sample::default()
            },
        };
        if self.rng.chance(self.drop_rate) {
            self.ring_drops += 1;
        } else {
            self.pending.push_back(Record::Sample(sample));
            if self.chains {
                self.pending_frames.push_back(frames);
            }
        }
        true
    }
}

/// Produces every pCPU's records, sample by sample.
pub struct Generator {
    header: Header,
    pcpus: Vec<PcpuSim>,
}

impl Generator {
    /// A generator for `cfg`.
    #[must_use]
    pub fn new(cfg: &SynthConfig) -> Self {
        let mut rng = Rng::new(cfg.seed);
        let period = cfg.period_ticks();
        let npcpus = cfg.pcpus.max(1);
        let mut header = Header {
            build_id: BuildId::new(&rng.next_u64().to_le_bytes().repeat(3)[..20])
                .unwrap_or_default(),
            tsc_hz: cfg.tsc_hz,
            pcpus: npcpus,
            tsc_skew: 180,
            period_ticks: period,
            source: SOURCE_DEADLINE,
            ..Header::default()
        };
        let boot = 40 * cfg.tsc_hz + rng.below(cfg.tsc_hz);
        let hv = Space::random(&mut rng, 0, 0xffff_8000_0020_0000, 0x4_0000, 10);
        let mut pcpus: Vec<PcpuSim> = (0..npcpus)
            .map(|p| PcpuSim {
                pcpu: p,
                rng: Rng::new(cfg.seed.wrapping_mul(1000).wrapping_add(u64::from(p) + 1)),
                period,
                deadline: boot + u64::from(p) * 37 + period,
                last_sample_tsc: boot + u64::from(p) * 37,
                vcpus: Vec::new(),
                current: None,
                slice_end: 0,
                cost_base: 1400 + 50 * u32::from(p % 4),
                hv: hv.clone(),
                idle_rip: 0xffff_8000_0020_0000 + 0x1234,
                samples_left: cfg.samples_per_pcpu,
                ring_drops: 0,
                drop_rate: cfg.ring_drop_rate,
                pending: VecDeque::new(),
                pending_frames: VecDeque::new(),
                chains: cfg.chains,
            })
            .collect();
        let mut global = 0usize;
        let mut vpid = 1u16;
        for (id, (name, image, vcpus, linux)) in VMS.iter().enumerate() {
            let id = id as u16;
            let _ = header.vms.push(VmInfo {
                id,
                name: FixedStr::truncated(name),
                vcpus: *vcpus,
                image: FixedStr::truncated(image),
                image_build_id: BuildId::new(&rng.next_u64().to_be_bytes().repeat(3)[..20])
                    .unwrap_or_default(),
            });
            // The guest's kernel and processes, shared by its vCPUs.
            let kernel = if *linux {
                Space::random(&mut rng, 0, 0xffff_ffff_8100_0000, 0x100_0000, 20)
            } else {
                Space::random(&mut rng, 0x0010_0000, 0x0010_0000, 0x4_0000, 14)
            };
            let procs: Vec<Space> = if *linux {
                (0..5)
                    .map(|_| {
                        let cr3 = 0x1_0000_0000 + (rng.below(0x10_0000) << 12);
                        let text = 0x5555_5555_0000 + (rng.below(0x1000) << 12);
                        let mut s = Space::random(&mut rng, cr3, text, 0x10_0000, 12);
                        s.cr3 = cr3;
                        s
                    })
                    .collect()
            } else {
                Vec::new()
            };
            for v in 0..*vcpus {
                let p = global % usize::from(npcpus);
                pcpus[p].vcpus.push(VcpuSim {
                    vm: id,
                    vcpu: v,
                    vpid,
                    long_mode: *linux,
                    procs: procs.clone(),
                    kernel: kernel.clone(),
                    cur_proc: 0,
                    in_kernel: !*linux,
                    cur_func: 0,
                    rip: 0,
                    exit_reason: NO_EXIT,
                    halted_until: 0,
                    halt_rate: if *linux { 0.01 } else { 0.03 },
                });
                global += 1;
                vpid += 1;
            }
        }
        Self { header, pcpus }
    }

    /// The header describing the trace.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Number of pCPUs.
    #[must_use]
    pub fn pcpus(&self) -> usize {
        self.pcpus.len()
    }

    /// Next record of pCPU `pcpu`, `None` when it is done.
    pub fn next_record(&mut self, pcpu: usize) -> Option<Record> {
        let mut frames = Vec::new();
        self.next_record_with_frames(pcpu, &mut frames)
    }

    /// Next record of pCPU `pcpu` (`None` when it is done); a sample's chain frames (host then
    /// guest, with `SynthConfig::chains`) are added to `frames`.
    pub fn next_record_with_frames(
        &mut self,
        pcpu: usize,
        frames: &mut Vec<u64>,
    ) -> Option<Record> {
        let p = self.pcpus.get_mut(pcpu)?;
        loop {
            if let Some(r) = p.pending.pop_front() {
                if p.chains && matches!(r, Record::Sample(_)) {
                    frames.extend(p.pending_frames.pop_front().unwrap_or_default());
                }
                return Some(r);
            }
            if !p.step() {
                return None;
            }
        }
    }

    /// pCPU `pcpu`'s ring drops so far.
    #[must_use]
    pub fn ring_drops(&self, pcpu: usize) -> u64 {
        self.pcpus.get(pcpu).map_or(0, |p| p.ring_drops)
    }
}

/// One pCPU's synthetic records.
#[derive(Clone, Debug)]
pub struct PcpuTrace {
    /// The pCPU.
    pub pcpu: u16,
    /// Its records in order.
    pub records: Vec<Record>,
    /// Its final ring-drop count.
    pub ring_drops: u64,
    /// Its samples' chain frames (with `SynthConfig::chains`; see [`crate::with_chains`]).
    pub frames: Vec<u64>,
}

/// A whole synthetic trace.
#[derive(Clone, Debug)]
pub struct SynthTrace {
    /// The header.
    pub header: Header,
    /// Per pCPU.
    pub pcpus: Vec<PcpuTrace>,
}

/// Generates a whole trace in memory.
#[must_use]
pub fn generate(cfg: &SynthConfig) -> SynthTrace {
    let mut g = Generator::new(cfg);
    let pcpus = (0..g.pcpus())
        .map(|i| {
            let (mut records, mut frames) = (Vec::new(), Vec::new());
            while let Some(r) = g.next_record_with_frames(i, &mut frames) {
                records.push(r);
            }
            PcpuTrace {
                pcpu: g.pcpus[i].pcpu,
                records,
                ring_drops: g.ring_drops(i),
                frames,
            }
        })
        .collect();
    SynthTrace {
        header: g.header.clone(),
        pcpus,
    }
}

/// How to lay out a synthetic capture.
#[derive(Clone, Debug)]
pub struct CaptureOptions {
    /// Records per block.
    pub block_records: usize,
    /// Insert a console text line after every this many frames (0: no text).
    pub console_every: usize,
    /// Keep each block's records in its [`FrameInfo`].
    pub keep_records: bool,
    /// Send the header again before the end frame.
    pub header_at_end: bool,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        Self {
            block_records: 64,
            console_every: 0,
            keep_records: true,
            header_at_end: false,
        }
    }
}

/// Which frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// The header.
    Header,
    /// A block.
    Block {
        /// Its header.
        header: BlockHeader,
        /// Samples in it.
        samples: u64,
        /// Events in it.
        events: u64,
    },
    /// The end frame.
    End,
}

/// Where a frame is in a capture.
#[derive(Clone, Debug)]
pub struct FrameInfo {
    /// Its bytes, both `0x00` delimiters included.
    pub range: Range<usize>,
    /// What it is.
    pub kind: FrameKind,
    /// Its records (blocks, with `keep_records`).
    pub records: Vec<Record>,
}

/// A synthetic capture: the byte stream and what is in it.
#[derive(Clone, Debug)]
pub struct Capture {
    /// The header sent.
    pub header: Header,
    /// The stream.
    pub bytes: Vec<u8>,
    /// The frames in stream order.
    pub frames: Vec<FrameInfo>,
    /// The console text spans (no delimiters).
    pub text: Vec<Range<usize>>,
    /// The end frame's totals.
    pub totals: Vec<PcpuTotals>,
    /// Samples in blocks.
    pub samples: u64,
}

const CONSOLE: [&str; 6] = [
    "[web:0] [   12.804113] e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex\n",
    "[db:1] postgres: checkpoint complete: wrote 1187 buffers (7.2%)\n",
    "[rtos] tick 48213 ok\n",
    "hvprof: pcpu 2: vm web vcpu 1 halted\n",
    "[web:1] [   13.100002] systemd[1]: Started Daily apt upgrade and clean activities.\n",
    "hvprof: exporter: ring 0 at 37% \u{2014} draining\n",
];

/// Builds a capture: header, blocks round-robin over the pCPUs (the exporter draining rings),
/// optional console lines, end frame.
#[must_use]
pub fn capture(cfg: &SynthConfig, opts: &CaptureOptions) -> Capture {
    let mut g = Generator::new(cfg);
    let block_records = opts.block_records.clamp(1, crate::MAX_BLOCK_RECORDS);
    let mut out = Capture {
        header: g.header.clone(),
        bytes: Vec::new(),
        frames: Vec::new(),
        text: Vec::new(),
        totals: Vec::new(),
        samples: 0,
    };
    let chain_frames = if cfg.chains {
        block_records * 2 * crate::MAX_CHAIN_DEPTH
    } else {
        0
    };
    let mut buf =
        vec![0u8; max_block_frame_len(block_records, chain_frames).max(MAX_HEADER_FRAME_LEN)];
    let mut text_rng = Rng::new(cfg.seed ^ 0xc0ffee);
    let mut push_frame =
        |out: &mut Capture, frame: &[u8], kind: FrameKind, records: Vec<Record>| {
            let start = out.bytes.len();
            out.bytes.extend_from_slice(frame);
            out.frames.push(FrameInfo {
                range: start..out.bytes.len(),
                kind,
                records,
            });
            if opts.console_every > 0 && out.frames.len().is_multiple_of(opts.console_every) {
                let line = CONSOLE[text_rng.below(CONSOLE.len() as u64) as usize];
                let start = out.bytes.len();
                out.bytes.extend_from_slice(line.as_bytes());
                out.text.push(start..out.bytes.len());
            }
        };
    let n = encode_header(&g.header, &mut buf).expect("buffer sized for a header");
    push_frame(&mut out, &buf[..n], FrameKind::Header, Vec::new());
    let mut encoders: Vec<BlockEncoder> = (0..g.pcpus())
        .map(|i| BlockEncoder::new(g.pcpus[i].pcpu, g.header.period_ticks))
        .collect();
    let mut done = vec![false; g.pcpus()];
    let mut records = Vec::with_capacity(block_records);
    let mut frames = Vec::new();
    while done.iter().any(|d| !d) {
        for i in 0..g.pcpus() {
            if done[i] {
                continue;
            }
            records.clear();
            frames.clear();
            while records.len() < block_records {
                match g.next_record_with_frames(i, &mut frames) {
                    Some(r) => records.push(r),
                    None => {
                        done[i] = true;
                        break;
                    }
                }
            }
            if records.is_empty() {
                continue;
            }
            let header = encoders[i].next_header(g.ring_drops(i));
            let n = encoders[i]
                .encode(&records, &frames, g.ring_drops(i), &mut buf)
                .expect("buffer sized by max_block_frame_len");
            let samples = records
                .iter()
                .filter(|r| matches!(r, Record::Sample(_)))
                .count() as u64;
            out.samples += samples;
            let kind = FrameKind::Block {
                header,
                samples,
                events: records.len() as u64 - samples,
            };
            let kept = if opts.keep_records {
                records.clone()
            } else {
                Vec::new()
            };
            push_frame(&mut out, &buf[..n], kind, kept);
        }
    }
    if opts.header_at_end {
        let n = encode_header(&g.header, &mut buf).expect("buffer sized for a header");
        push_frame(&mut out, &buf[..n], FrameKind::Header, Vec::new());
    }
    out.totals = (0..g.pcpus().min(MAX_END_PCPUS))
        .map(|i| encoders[i].totals(g.ring_drops(i)))
        .collect();
    let mut end = vec![0u8; max_end_frame_len(out.totals.len())];
    let n = encode_end(&out.totals, &mut end).expect("buffer sized by max_end_frame_len");
    push_frame(&mut out, &end[..n], FrameKind::End, Vec::new());
    out
}

/// Encodes `records` as consecutive blocks of `block_records` for pCPU `pcpu` (no header, no end
/// frame); returns the bytes.
#[must_use]
pub fn encode_blocks(pcpu: u16, records: &[Record], period: u64, block_records: usize) -> Vec<u8> {
    let block_records = block_records.clamp(1, crate::MAX_BLOCK_RECORDS);
    let mut enc = BlockEncoder::new(pcpu, period);
    let mut buf = vec![0u8; max_block_frame_len(block_records, 0)];
    let mut out = Vec::new();
    for chunk in records.chunks(block_records) {
        let n = enc
            .encode(chunk, &[], 0, &mut buf)
            .expect("buffer sized by max_block_frame_len");
        out.extend_from_slice(&buf[..n]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_deterministic_and_plausible() {
        let cfg = SynthConfig {
            samples_per_pcpu: 3000,
            ..SynthConfig::default()
        };
        let a = generate(&cfg);
        let b = generate(&cfg);
        assert_eq!(a.pcpus.len(), 4);
        for (x, y) in a.pcpus.iter().zip(&b.pcpus) {
            assert_eq!(x.records, y.records);
        }
        let all: Vec<&Sample> = a
            .pcpus
            .iter()
            .flat_map(|p| p.records.iter().filter_map(Record::as_sample))
            .collect();
        let n = all.len() as f64;
        let guest = all.iter().filter(|s| s.kind == SampleKind::Guest).count() as f64;
        let hv = all
            .iter()
            .filter(|s| s.kind == SampleKind::Hypervisor)
            .count() as f64;
        let idle = all.iter().filter(|s| s.kind == SampleKind::Idle).count() as f64;
        assert!(guest / n > 0.5, "guest share {}", guest / n);
        assert!(hv > 0.0 && idle > 0.0);
        // TSCs increase on every pCPU, about one period apart.
        for p in &a.pcpus {
            let ts: Vec<u64> = p
                .records
                .iter()
                .filter_map(Record::as_sample)
                .map(|s| s.tsc)
                .collect();
            for w in ts.windows(2) {
                assert!(w[1] > w[0]);
                assert!(w[1] - w[0] < 3 * cfg.period_ticks());
            }
        }
    }

    #[test]
    fn chains_are_optional_and_decode_as_generated() {
        let cfg = SynthConfig {
            pcpus: 2,
            samples_per_pcpu: 4000,
            ..SynthConfig::default()
        };
        // Off by default: no chain, no frame.
        let plain = generate(&cfg);
        assert!(plain.pcpus.iter().all(|p| p.frames.is_empty()));
        assert!(plain.pcpus.iter().all(|p| {
            p.records
                .iter()
                .filter_map(Record::as_sample)
                .all(|s| s.host_chain == Chain::NOT_WALKED && s.guest_chain == Chain::NOT_WALKED)
        }));
        let cfg = SynthConfig {
            chains: true,
            ..cfg
        };
        let trace = generate(&cfg);
        // The same samples, with chains.
        for (a, b) in plain.pcpus.iter().zip(&trace.pcpus) {
            let strip = |r: &Record| match r {
                Record::Sample(s) => Record::Sample(Sample {
                    host_chain: Chain::NOT_WALKED,
                    guest_chain: Chain::NOT_WALKED,
                    ..*s
                }),
                e => *e,
            };
            assert_eq!(a.records, b.records.iter().map(strip).collect::<Vec<_>>());
        }
        let samples: Vec<(&Sample, crate::Chains)> = trace
            .pcpus
            .iter()
            .flat_map(|p| {
                crate::with_chains(&p.records, &p.frames)
                    .filter_map(|(r, c)| Some((r.as_sample()?, c)))
            })
            .collect();
        let exit_causes = samples
            .iter()
            .filter(|(s, c)| {
                s.kind == SampleKind::Hypervisor && c.guest.first() == Some(&s.guest_rip)
            })
            .count();
        assert!(exit_causes > 0);
        assert!(
            samples
                .iter()
                .any(|(s, _)| s.guest_chain.end() == ChainEnd::BadFrame)
        );
        assert!(samples.iter().any(|(_, c)| c.guest.len() >= 3));
        assert!(samples.iter().all(|(s, c)| {
            c.host.len() == s.host_chain.depth() && c.guest.len() == s.guest_chain.depth()
        }));
        // The capture decodes to the same records and frames.
        let cap = capture(&cfg, &CaptureOptions::default());
        let d = crate::decode(&cap.bytes);
        for p in &trace.pcpus {
            let log = &d.pcpus[&p.pcpu];
            assert_eq!(log.records, p.records);
            assert_eq!(log.frames, p.frames);
        }
    }
}
