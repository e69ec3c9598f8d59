//! The timeline: stacked bars over host time (plotters, SVG), one row per pCPU and one per
//! vCPU. Each bar is one time bin; its segments are the shares of the row's samples in that bin
//! by state: for pCPU rows, each VM's guest (one stable colour per VM, named in the legend: who
//! held the pCPU), for vCPU rows guest user and guest kernel; the hypervisor by exit reason (and
//! for no VM), idle, and for vCPU rows steal.
//!
//! A pCPU row holds that pCPU's samples. A vCPU row holds its virtual sample stream on the host
//! time axis (`timeline::runs`, the report's `[steal]`/`[idle]` slots): its own samples as
//! guest user/kernel, the hypervisor's work on its exits while it was in by exit reason (the
//! report's `[steal] (hypervisor)`), the scheduler's work while it was out as "hypervisor: no VM",
//! halted slots as idle, and every other slot while it was out (another VM or vCPU held its
//! pCPU) as steal; in a dark shade of its own where a pause-loop exit began the stretch out
//! (the vCPU gave its pCPU up spinning: "steal: yielded spinning").

use std::fmt::Write as _;

use anyhow::{Context, Result};
use plotters::prelude::*;
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{NO_EXIT, NO_VM};

use crate::model::losses::LossRange;
use crate::model::profile::Profile;
use crate::model::samples::{Sampled, What};
use crate::model::timeline::{Class, time_runs};
use crate::naming::namer::exit_name;

/// [`State::Hypervisor`] of every exit reason that is not one (128 and above).
pub const INVALID_EXIT: u16 = 0xfffe;

/// The state of one slot of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// VM `vm`'s guest, user or kernel mode (pCPU rows).
    Vm(u16),
    GuestUser,
    GuestKernel,
    /// The hypervisor on a vCPU's exit (its last exit reason).
    Hypervisor(u16),
    /// The hypervisor for no VM (the scheduler, the export).
    HypervisorNoVm,
    Idle,
    Steal,
    /// Steal that a pause-loop exit began: the vCPU gave its pCPU up spinning (vCPU rows).
    Yielded,
}

impl State {
    pub fn label(self) -> String {
        match self {
            State::Vm(vm) => format!("VM {vm}"),
            State::GuestUser => "guest user".into(),
            State::GuestKernel => "guest kernel".into(),
            State::Hypervisor(NO_EXIT) => "hypervisor: no exit yet".into(),
            State::Hypervisor(INVALID_EXIT) => "hypervisor: invalid exit reason".into(),
            State::Hypervisor(r) => format!("hypervisor: {}", exit_name(r)),
            State::HypervisorNoVm => "hypervisor: no VM".into(),
            State::Idle => "idle".into(),
            State::Steal => "steal".into(),
            State::Yielded => "steal: yielded spinning (pause-loop exit)".into(),
        }
    }

    /// A pCPU sample's state.
    pub fn of(s: &Sampled) -> State {
        match s.what {
            What::GuestUser => State::GuestUser,
            What::GuestKernel => State::GuestKernel,
            What::Hypervisor if s.vm == NO_VM => State::HypervisorNoVm,
            // Basic exit reasons are below 128 (Intel SDM Vol. 3D Table C-1): any other is one
            // state, so a forged log cannot make a state (and a legend entry) per sample.
            What::Hypervisor if s.exit < 128 || s.exit == NO_EXIT => State::Hypervisor(s.exit),
            What::Hypervisor => State::Hypervisor(INVALID_EXIT),
            What::Idle => State::Idle,
        }
    }
}

/// One stable colour per VM, by its id: none of the fixed states' (guest user green, guest
/// kernel blue, steal red, greys) nor the exit reasons' palette.
const VM_COLORS: [(u8, u8, u8); 8] = [
    (0, 128, 128),
    (107, 142, 35),
    (25, 25, 112),
    (128, 0, 64),
    (160, 120, 40),
    (90, 60, 170),
    (0, 90, 60),
    (70, 130, 180),
];

/// VM `vm`'s colour.
pub fn vm_color(vm: u16) -> RGBColor {
    let (r, g, b) = VM_COLORS[usize::from(vm) % VM_COLORS.len()];
    // Beyond the palette, a darker shade of it.
    let k = u8::from(usize::from(vm) >= VM_COLORS.len());
    RGBColor(r >> k, g >> k, b >> k)
}

/// One row of the chart: a label and, per bin, the samples of each state.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub label: String,
    pub bins: Vec<HashMap<State, u64>>,
}

/// What the chart draws.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// TSC of the first sample, and ticks per bin.
    pub start: u64,
    pub bin_ticks: u64,
    /// Milliseconds per TSC tick (for the axis).
    pub ms_per_tick: f64,
    /// Every state present, in drawing order (bottom to top), with its color.
    pub states: Vec<(State, RGBColor)>,
    pub rows: Vec<Row>,
    /// The pCPUs of the first rows, in order (the vCPU rows follow).
    pub pcpus: Vec<u16>,
    /// Where records are missing (the report's): drawn over their pCPU's row.
    pub losses: Vec<LossRange>,
    /// The VMs' names, for the legend.
    pub vm_names: HashMap<u16, String>,
}

/// The overlay marking lost records.
pub const LOST_COLOR: RGBAColor = RGBAColor(200, 0, 0, 0.35);

const HYPERVISOR_COLORS: [(u8, u8, u8); 12] = [
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (188, 189, 34),
    (23, 190, 207),
    (255, 187, 120),
    (197, 176, 213),
    (196, 156, 148),
    (247, 182, 210),
    (219, 219, 141),
    (158, 218, 229),
];

/// The colors: fixed for the fixed states, a palette for the exit reasons (most frequent first);
/// every state gets a color of its own.
fn colors(states: &[State], counts: &HashMap<State, u64>) -> Vec<(State, RGBColor)> {
    let mut exits: Vec<State> = states
        .iter()
        .copied()
        .filter(|s| matches!(s, State::Hypervisor(_)))
        .collect();
    exits.sort_by_key(|s| (std::cmp::Reverse(counts.get(s).copied().unwrap_or(0)), *s));
    states
        .iter()
        .map(|&s| {
            let c = match s {
                State::Vm(vm) => vm_color(vm),
                State::GuestUser => RGBColor(44, 160, 44),
                State::GuestKernel => RGBColor(31, 119, 180),
                State::HypervisorNoVm => RGBColor(110, 110, 110),
                State::Idle => RGBColor(205, 205, 205),
                State::Steal => RGBColor(214, 39, 40),
                State::Yielded => RGBColor(128, 0, 38),
                State::Hypervisor(_) => {
                    let i = exits.iter().position(|e| *e == s).unwrap_or(0);
                    match HYPERVISOR_COLORS.get(i) {
                        Some(&(r, g, b)) => RGBColor(r, g, b),
                        // Beyond the palette: distinct dark shades.
                        None => {
                            let k = (i - HYPERVISOR_COLORS.len()) as u8;
                            RGBColor(60 + k.wrapping_mul(37) % 120, 40, 90 + k % 100)
                        }
                    }
                }
            };
            (s, c)
        })
        .collect()
}

/// A bin's samples (or some of them) by state, and the hypervisor's for no VM by the vCPU
/// they name (for a forged vCPU of no VM: see `timeline::Window::hypervisor_out`). Few states
/// are in one bin: lists.
#[derive(Clone, Default, Debug)]
struct Counts {
    states: Vec<(State, u64)>,
    hv_for: Vec<(u16, u64)>,
}

impl Counts {
    fn add(&mut self, st: State, hv_for: Option<u16>, n: u64) {
        match self.states.iter_mut().find(|(s, _)| *s == st) {
            Some((_, k)) => *k += n,
            None => self.states.push((st, n)),
        }
        if let Some(v) = hv_for {
            match self.hv_for.iter_mut().find(|(c, _)| *c == v) {
                Some((_, k)) => *k += n,
                None => self.hv_for.push((v, n)),
            }
        }
    }

    fn get(&self, st: State) -> u64 {
        self.states
            .iter()
            .find(|(s, _)| *s == st)
            .map_or(0, |&(_, n)| n)
    }

    fn hv_for(&self, vcpu: u16) -> u64 {
        self.hv_for
            .iter()
            .find(|(c, _)| *c == vcpu)
            .map_or(0, |&(_, n)| n)
    }

    fn total(&self) -> u64 {
        self.states.iter().map(|&(_, n)| n).sum()
    }

    /// These counts less `other`'s (a part of them).
    fn minus(&self, other: &Counts) -> Counts {
        Counts {
            states: self
                .states
                .iter()
                .map(|&(s, n)| (s, n - other.get(s)))
                .collect(),
            hv_for: self
                .hv_for
                .iter()
                .map(|&(c, n)| (c, n - other.hv_for(c)))
                .collect(),
        }
    }
}

/// A pCPU's pass over its samples: its runs' ends (TSCs, in order), and for each end met its
/// bin with the samples of that bin before it; the bin of the last sample and its samples so far.
#[derive(Default)]
struct Sweep {
    ends: Vec<u64>,
    before: Vec<(usize, Counts)>,
    bin: Option<usize>,
    so_far: Counts,
}

impl Sweep {
    /// Notes the next end, in bin `bin` (`None`: before the first bin), every sample before it
    /// (and none after) counted: in the bin of the last sample, those counted so far; in a
    /// later bin, none.
    fn note_end(&mut self, bin: Option<usize>) {
        self.before.push(match bin {
            Some(b) if self.bin == Some(b) => (b, self.so_far.clone()),
            Some(b) => (b, Counts::default()),
            None => (0, Counts::default()),
        });
    }
}

impl Timeline {
    /// Bins a profile's samples into `bins` bars per row (read again: the profile keeps them,
    /// `LoadOptions::keep_samples`).
    pub fn build(p: &Profile, bins: usize) -> Result<Timeline> {
        let bins = bins.max(1);
        let (start, end) = p.span();
        let bin_ticks = ((end - start) / bins as u64 + 1).max(1);
        let bin = |tsc: u64| (((tsc - start) / bin_ticks) as usize).min(bins - 1);
        // The bin of a run's end (`None`: before the first sample).
        let end_bin = |t: u64| t.checked_sub(start).map(|_| bin(t));
        let mut rows = Vec::new();
        let mut totals: HashMap<State, u64> = HashMap::default();
        // pCPU rows, and the vCPU rows from their virtual streams: a vCPU's run (from the
        // scheduling events) is a stretch of a pCPU's time whose samples are its slots. They are
        // counted from the pCPU row's bins, whole, and in the bins at the run's two ends from
        // the samples of that bin before each end, which the pass over the samples (in TSC
        // order) notes as it meets the ends: memory for the bins and the runs' ends, none per
        // sample.
        let pcpus = p.pcpu_list();
        let row_of: HashMap<u16, usize> = pcpus.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        let mut pcpu_bins: Vec<Vec<Counts>> = vec![vec![Counts::default(); bins]; pcpus.len()];
        let mut pcpu_rows: Vec<Vec<HashMap<State, u64>>> =
            vec![vec![HashMap::default(); bins]; pcpus.len()];
        let runs = time_runs(&p.events);
        // Per pCPU, its runs' ends in order (TSCs), and what its pass has counted so far.
        let mut sweeps: Vec<Sweep> = (0..pcpus.len()).map(|_| Sweep::default()).collect();
        for r in &runs {
            if let Some(&i) = row_of.get(&r.pcpu) {
                sweeps[i].ends.push(r.from);
                sweeps[i].ends.extend(r.to);
            }
        }
        for sw in &mut sweeps {
            sw.ends.sort_unstable();
            sw.ends.dedup();
        }
        let mut vrows: HashMap<(u16, u16), Vec<HashMap<State, u64>>> = HashMap::default();
        p.for_each_sample(|s| {
            let Some(&i) = row_of.get(&s.pcpu) else {
                return;
            };
            let b = bin(s.tsc);
            let st = State::of(s);
            let sw = &mut sweeps[i];
            while let Some(&t) = sw.ends.get(sw.before.len())
                && t <= s.tsc
            {
                sw.note_end(end_bin(t));
            }
            if sw.bin != Some(b) {
                sw.bin = Some(b);
                sw.so_far = Counts::default();
            }
            let hv_for = (st == State::HypervisorNoVm).then_some(s.vcpu);
            sw.so_far.add(st, hv_for, 1);
            pcpu_bins[i][b].add(st, hv_for, 1);
            // The pCPU row: who held it.
            let held = match st {
                State::GuestUser | State::GuestKernel => State::Vm(s.vm),
                other => other,
            };
            *pcpu_rows[i][b].entry(held).or_default() += 1;
            *totals.entry(held).or_default() += 1;
            if p.events.is_empty() && s.vm != NO_VM && s.what != What::Idle {
                // No scheduling events: a vCPU's row is its own samples and the hypervisor's
                // on its exits.
                let row = vrows
                    .entry((s.vm, s.vcpu))
                    .or_insert_with(|| vec![HashMap::default(); bins]);
                *row[b].entry(st).or_default() += 1;
                *totals.entry(st).or_default() += 1;
            }
        })?;
        for sw in &mut sweeps {
            while let Some(&t) = sw.ends.get(sw.before.len()) {
                sw.note_end(end_bin(t));
            }
        }
        // Where each end is: its bin, and the samples of that bin before it.
        let at = |i: usize, t: u64| -> (usize, &Counts) {
            let sw = &sweeps[i];
            let k = sw.ends.partition_point(|&e| e < t);
            let (b, counts) = &sw.before[k];
            (*b, counts)
        };
        let empty = Counts::default();
        for r in &runs {
            let Some(&i) = row_of.get(&r.pcpu) else {
                continue;
            };
            let whole = &pcpu_bins[i];
            let (lo, lo_before) = at(i, r.from);
            let (hi, hi_before) = match r.to {
                Some(t) => at(i, t),
                None => (bins - 1, &whole[bins - 1]),
            };
            // Per bin, the run's samples by state (and the hypervisor's for no VM by vCPU).
            let mut cells: Vec<(usize, Counts)> = Vec::new();
            for (b, w) in whole.iter().enumerate().take(hi + 1).skip(lo) {
                let upto = if b == hi { hi_before } else { w };
                let from = if b == lo { lo_before } else { &empty };
                let c = upto.minus(from);
                if c.total() > 0 {
                    cells.push((b, c));
                }
            }
            if cells.is_empty() {
                continue;
            }
            let row = vrows
                .entry(r.vcpu)
                .or_insert_with(|| vec![HashMap::default(); bins]);
            for (b, c) in cells {
                let cell = &mut row[b];
                let mut add = |st: State, n: u64| {
                    if n > 0 {
                        *cell.entry(st).or_default() += n;
                        *totals.entry(st).or_default() += n;
                    }
                };
                match r.class {
                    Class::OutHalted => add(State::Idle, c.total()),
                    Class::Out => {
                        // As `timeline::Window::hypervisor_out` counts it.
                        let hv = if r.vcpu.0 == NO_VM {
                            c.hv_for(r.vcpu.1)
                        } else {
                            c.get(State::HypervisorNoVm)
                        };
                        add(State::HypervisorNoVm, hv);
                        let steal = if r.yielded {
                            State::Yielded
                        } else {
                            State::Steal
                        };
                        add(steal, c.total() - hv);
                    }
                    // Its own samples and the hypervisor's on its exits, as the pCPU's.
                    Class::In => {
                        for &(st, n) in &c.states {
                            add(st, n);
                        }
                    }
                }
            }
        }
        for (row, &c) in pcpu_rows.into_iter().zip(&pcpus) {
            rows.push(Row {
                label: format!("pCPU {c}"),
                bins: row,
            });
        }
        let mut keys: Vec<(u16, u16)> = vrows.keys().copied().collect();
        keys.sort_unstable();
        for (vm, vcpu) in keys {
            rows.push(Row {
                label: format!("{} vCPU {vcpu}", p.vm_name(vm)),
                bins: vrows.remove(&(vm, vcpu)).unwrap_or_default(),
            });
        }
        let mut states: Vec<State> = totals.keys().copied().collect();
        states.sort_unstable();
        Ok(Timeline {
            start,
            bin_ticks,
            ms_per_tick: if p.tsc_hz == 0 {
                1e-6
            } else {
                1e3 / p.tsc_hz as f64
            },
            vm_names: states
                .iter()
                .filter_map(|s| match *s {
                    State::Vm(vm) => Some((vm, p.vm_name(vm))),
                    _ => None,
                })
                .collect(),
            states: colors(&states, &totals),
            rows,
            pcpus,
            losses: p.losses.clone(),
        })
    }

    /// A state's name in the legend: a VM by its name.
    pub fn label(&self, state: State) -> String {
        match state {
            State::Vm(vm) => match self.vm_names.get(&vm) {
                Some(name) => format!("VM {name}"),
                None => state.label(),
            },
            _ => state.label(),
        }
    }

    /// Where a TSC falls on the time axis, in `per_ms` units (clamped to the axis).
    fn x_of(&self, tsc: u64, per_ms: f64, x_max: f64) -> f64 {
        (tsc.saturating_sub(self.start) as f64 * self.ms_per_tick * per_ms).min(x_max)
    }

    /// The loss ranges of `pcpu` on the time axis (`per_ms` units): from the last record before
    /// to the first after (the axis' ends when there is none), at least 0.4 % of the axis wide
    /// so that a short one shows.
    pub fn loss_spans(&self, pcpu: u16, per_ms: f64, x_max: f64) -> Vec<(f64, f64)> {
        let min_w = x_max * 0.004;
        self.losses
            .iter()
            .filter(|l| l.pcpu == pcpu)
            .map(|l| {
                let x0 = l.from_tsc.map_or(0.0, |t| self.x_of(t, per_ms, x_max));
                let x1 = l.to_tsc.map_or(x_max, |t| self.x_of(t, per_ms, x_max));
                if x1 - x0 < min_w {
                    let mid = (x0 + x1) / 2.0;
                    ((mid - min_w / 2.0).max(0.0), (mid + min_w / 2.0).min(x_max))
                } else {
                    (x0, x1)
                }
            })
            .collect()
    }

    /// The bars drawn for each state: (row, bin) cells where it has samples.
    pub fn bars_per_state(&self) -> HashMap<State, usize> {
        let mut out: HashMap<State, usize> = HashMap::default();
        for r in &self.rows {
            for b in &r.bins {
                for (s, &n) in b {
                    if n > 0 {
                        *out.entry(*s).or_default() += 1;
                    }
                }
            }
        }
        out
    }

    /// The chart as SVG.
    pub fn svg(&self, title: &str) -> Result<String> {
        let row_h = 120u32;
        let legend_cols = 4usize;
        let legend_entries = self.states.len() + usize::from(!self.losses.is_empty());
        let legend_rows = legend_entries.div_ceil(legend_cols) as u32;
        let (w, title_h, legend_h) = (1200u32, 36u32, 24 * legend_rows + 16);
        let h = title_h + row_h * self.rows.len().max(1) as u32 + legend_h + 20;
        let mut buf = String::new();
        {
            let root = SVGBackend::with_string(&mut buf, (w, h)).into_drawing_area();
            root.fill(&WHITE).map_err(draw_err)?;
            let (top, rest) = root.split_vertically(title_h);
            top.draw_text(
                title,
                &("sans-serif", 20).into_font().color(&BLACK),
                (10, 8),
            )
            .map_err(draw_err)?;
            let (plots, legend) = rest.split_vertically(row_h * self.rows.len().max(1) as u32);
            let n_bins = self.rows.first().map_or(1, |r| r.bins.len());
            // Milliseconds for runs up to 10 s, seconds beyond.
            let span_ms = self.bin_ticks as f64 * n_bins as f64 * self.ms_per_tick;
            let (per_ms, unit) = if span_ms > 10_000.0 {
                (1e-3, "s")
            } else {
                (1.0, "ms")
            };
            let x_max = span_ms * per_ms;
            let x_desc = format!("host time ({unit} since the first sample)");
            let areas = plots.split_evenly((self.rows.len().max(1), 1));
            for (ri, (row, area)) in self.rows.iter().zip(areas.iter()).enumerate() {
                let last = ri + 1 == self.rows.len();
                let mut chart = ChartBuilder::on(area)
                    .margin_left(10)
                    .margin_right(20)
                    .margin_top(4)
                    .caption(&row.label, ("sans-serif", 14))
                    .x_label_area_size(30)
                    .y_label_area_size(48)
                    .build_cartesian_2d(0f64..x_max, 0f64..100f64)
                    .map_err(draw_err)?;
                let mut mesh = chart.configure_mesh();
                mesh.disable_mesh()
                    .label_style(("sans-serif", 12))
                    .axis_desc_style(("sans-serif", 13))
                    .y_labels(3)
                    .y_label_formatter(&|y| format!("{y:.0}%"))
                    .x_labels(10)
                    .x_label_formatter(&|x| format!("{x:.0}"));
                if last {
                    mesh.x_desc(x_desc.as_str());
                }
                mesh.draw().map_err(draw_err)?;
                let bin_w = self.bin_ticks as f64 * self.ms_per_tick * per_ms;
                // One series per state, stacked bottom to top in the legend's order.
                let mut base = vec![0f64; row.bins.len()];
                for &(state, color) in &self.states {
                    let mut rects = Vec::new();
                    for (b, counts) in row.bins.iter().enumerate() {
                        let total: u64 = counts.values().sum();
                        let n = counts.get(&state).copied().unwrap_or(0);
                        if n == 0 || total == 0 {
                            continue;
                        }
                        let y0 = base[b];
                        let y1 = y0 + 100.0 * n as f64 / total as f64;
                        base[b] = y1;
                        let x0 = b as f64 * bin_w;
                        rects.push(Rectangle::new([(x0, y0), (x0 + bin_w, y1)], color.filled()));
                    }
                    chart.draw_series(rects).map_err(draw_err)?;
                }
                // Lost records, over the pCPU's row.
                if let Some(&pcpu) = self.pcpus.get(ri) {
                    let spans = self.loss_spans(pcpu, per_ms, x_max);
                    chart
                        .draw_series(spans.into_iter().map(|(x0, x1)| {
                            Rectangle::new([(x0, 0.0), (x1, 100.0)], LOST_COLOR.filled())
                        }))
                        .map_err(draw_err)?;
                }
            }
            // The legend: one swatch per state.
            let font = ("sans-serif", 13).into_font().color(&BLACK);
            let lost = (!self.losses.is_empty()).then(|| ("records lost".to_owned(), LOST_COLOR));
            let entries = self
                .states
                .iter()
                .map(|(state, color)| (self.label(*state), color.to_rgba()))
                .chain(lost);
            for (i, (label, color)) in entries.enumerate() {
                let (col, line) = ((i % legend_cols) as i32, (i / legend_cols) as i32);
                let (x, y) = (60 + col * 280, 10 + line * 24);
                legend
                    .draw(&Rectangle::new([(x, y), (x + 16, y + 14)], color.filled()))
                    .map_err(draw_err)?;
                legend
                    .draw_text(&label, &font, (x + 22, y))
                    .map_err(draw_err)?;
            }
            root.present().map_err(draw_err)?;
        }
        Ok(buf)
    }

    /// A one-line description per row (the shares over the whole run), for text output.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for r in &self.rows {
            let mut t: HashMap<State, u64> = HashMap::default();
            for b in &r.bins {
                for (s, n) in b {
                    *t.entry(*s).or_default() += n;
                }
            }
            let total: u64 = t.values().sum();
            let parts: Vec<String> = self
                .states
                .iter()
                .filter_map(|(s, _)| {
                    let n = *t.get(s)?;
                    Some(format!(
                        "{} {:.1}%",
                        self.label(*s),
                        100.0 * n as f64 / total.max(1) as f64
                    ))
                })
                .collect();
            let _ = writeln!(out, "{}: {}", r.label, parts.join(", "));
        }
        for l in &self.losses {
            let _ = writeln!(out, "lost: {}", l.describe());
        }
        out
    }
}

fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotters: {e:?}")
}

/// Writes the timeline SVG of a profile.
pub fn write(p: &Profile, bins: usize, title: &str, out: &mut dyn std::io::Write) -> Result<()> {
    let t = Timeline::build(p, bins)?;
    out.write_all(t.svg(title)?.as_bytes())
        .context("cannot write the timeline")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::profile::LoadOptions;
    use crate::model::progress::Progress;
    use crate::model::timeline::{Owner, Slot, naive_classify};
    use crate::naming::symbols::Images;
    use hvprof_samplelog::{
        Event, EventKind, OutReason, Record, Sample, SampleKind, guest_mode, synth,
    };
    use proptest::prelude::*;

    /// A capture of each pCPU's `records`.
    fn capture(records: &[Vec<Record>]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for (pcpu, r) in records.iter().enumerate() {
            bytes.extend(synth::encode_blocks(pcpu as u16, r, 10, 64));
        }
        bytes
    }

    fn profile(records: &[Vec<Record>]) -> Profile {
        Profile::from_bytes(
            &capture(records),
            &Images::default(),
            LoadOptions::all(2),
            &Progress::hidden(),
        )
    }

    /// The vCPU rows as the chart drew them slot by slot before it counted runs.
    fn naive_vcpu_rows(p: &Profile, bins: usize) -> Vec<Row> {
        let (start, end) = p.span();
        let bin_ticks = ((end - start) / bins as u64 + 1).max(1);
        let bin = |tsc: u64| (((tsc - start) / bin_ticks) as usize).min(bins - 1);
        let mut per_pcpu: HashMap<u16, Vec<Sampled>> = HashMap::default();
        p.for_each_sample(|s| per_pcpu.entry(s.pcpu).or_default().push(*s))
            .unwrap();
        let lists: HashMap<u16, Vec<(u64, Owner)>> = per_pcpu
            .iter()
            .map(|(&c, idx)| {
                let l = idx.iter().map(|s| (s.tsc, s.owner()));
                (c, l.collect())
            })
            .collect();
        let mut rows: HashMap<(u16, u16), Vec<HashMap<State, u64>>> = HashMap::default();
        // Each vCPU's events in TSC order (stable): whether its latest at a TSC was a yield.
        let mut tracks: HashMap<(u16, u16), Vec<Event>> = HashMap::default();
        for (_, e) in &p.events {
            tracks.entry((e.vm, e.vcpu)).or_default().push(*e);
        }
        for t in tracks.values_mut() {
            t.sort_by_key(|e| e.tsc);
        }
        let yielded = |key: (u16, u16), tsc: u64| {
            let t = &tracks[&key];
            let k = t.partition_point(|e| e.tsc <= tsc);
            k > 0 && t[k - 1].kind == EventKind::VcpuOut && t[k - 1].reason == OutReason::Yielded
        };
        naive_classify(&lists, &p.events, |key, pcpu, i, slot| {
            let s = &per_pcpu[&pcpu][i];
            let st = match slot {
                Slot::Own | Slot::Hypervisor => State::of(s),
                Slot::Idle => State::Idle,
                Slot::HypervisorOut => State::HypervisorNoVm,
                Slot::StealOn(_) | Slot::StealOutside(_) if yielded(key, s.tsc) => State::Yielded,
                Slot::StealOn(_) | Slot::StealOutside(_) => State::Steal,
            };
            let row = rows
                .entry(key)
                .or_insert_with(|| vec![HashMap::default(); bins]);
            *row[bin(s.tsc)].entry(st).or_default() += 1;
        });
        let mut keys: Vec<_> = rows.keys().copied().collect();
        keys.sort_unstable();
        keys.into_iter()
            .map(|(vm, vcpu)| Row {
                label: format!("{} vCPU {vcpu}", p.vm_name(vm)),
                bins: rows.remove(&(vm, vcpu)).unwrap_or_default(),
            })
            .collect()
    }

    fn arb_record() -> impl Strategy<Value = (u64, Record)> {
        let vm = prop_oneof![Just(0u16), Just(1), Just(NO_VM)];
        let sample = (
            0u8..3,
            vm.clone(),
            0u16..3,
            any::<bool>(),
            prop_oneof![Just(1u16), Just(12), Just(48), Just(300), Just(NO_EXIT)],
        )
            .prop_map(|(kind, vm, vcpu, user, exit)| {
                Record::Sample(Sample {
                    kind: SampleKind::from_u8(kind).unwrap_or_default(),
                    vm,
                    vcpu,
                    guest_mode: guest_mode(if user { 3 } else { 0 }, 2),
                    exit_reason: exit,
                    guest_rip: 0x1000,
                    ..Sample::default()
                })
            });
        let event = (any::<bool>(), vm, 0u16..3, 0u8..4).prop_map(|(out, vm, vcpu, reason)| {
            Record::Event(Event {
                kind: if out {
                    EventKind::VcpuOut
                } else {
                    EventKind::VcpuIn
                },
                vm,
                vcpu,
                reason: OutReason::from_u8(reason).unwrap_or_default(),
                tsc: 0,
            })
        });
        (0u64..40, prop_oneof![3 => sample, 1 => event])
    }

    fn with_tsc(records: Vec<(u64, Record)>) -> Vec<Record> {
        let mut t = 0u64;
        records
            .into_iter()
            .map(|(dt, mut r)| {
                t += dt;
                match &mut r {
                    Record::Sample(s) => s.tsc = t,
                    Record::Event(e) => e.tsc = t,
                }
                r
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The vCPU rows counted per run are the rows classified slot by slot, bin by bin.
        #[test]
        fn vcpu_rows_equal_slot_by_slot(
            pcpus in prop::collection::vec(prop::collection::vec(arb_record(), 0..120), 1..4),
            bins in 1usize..12,
        ) {
            let records: Vec<Vec<Record>> = pcpus.into_iter().map(with_tsc).collect();
            let p = profile(&records);
            prop_assume!(!p.samples.is_empty() && !p.events.is_empty());
            let t = Timeline::build(&p, bins).unwrap();
            let pcpu_rows = p.pcpu_list().len();
            let naive = naive_vcpu_rows(&p, bins);
            prop_assert_eq!(&t.rows[pcpu_rows..], naive.as_slice());
        }
    }

    /// A decoded log with 2000 vCPUs (250 VMs of 8), each in once for 20 samples on one of two
    /// pCPUs and then out (preempted) for good, so that every later sample of its pCPU is its
    /// steal: the rows hold exactly that, bin by bin.
    #[test]
    fn thousands_of_vcpu_rows() {
        const K: u64 = 2000;
        const OWN: u64 = 20;
        const BINS: usize = 50;
        let mut records = vec![Vec::new(), Vec::new()];
        for k in 0..K {
            let (vm, vcpu) = ((k / 8) as u16, (k % 8) as u16);
            let t = 100 * k;
            let ev = |tsc, kind| {
                Record::Event(Event {
                    tsc,
                    kind,
                    vm,
                    vcpu,
                    reason: OutReason::Preempted,
                })
            };
            let r = &mut records[(k % 2) as usize];
            r.push(ev(t, EventKind::VcpuIn));
            r.extend((1..=OWN).map(|i| {
                Record::Sample(Sample {
                    tsc: t + i,
                    vm,
                    vcpu,
                    guest_mode: guest_mode(0, 2),
                    ..Sample::default()
                })
            }));
            r.push(ev(t + OWN + 1, EventKind::VcpuOut));
        }
        let (p, report) = crate::views::report::from_bytes(
            &capture(&records),
            &Images::default(),
            LoadOptions::all(2),
            &Progress::hidden(),
        );
        assert_eq!(p.samples.len() as u64, K * OWN);
        let t = Timeline::build(&p, BINS).unwrap();
        assert_eq!(t.rows.len(), 2 + K as usize);
        let (start, end) = p.span();
        let bin_ticks = (end - start) / BINS as u64 + 1;
        for k in 0..K {
            let row = &t.rows[2 + k as usize];
            assert_eq!(row.label, format!("vm{} vCPU {}", k / 8, k % 8));
            let mut want = vec![HashMap::<State, u64>::default(); BINS];
            for j in (k..K).step_by(2) {
                let st = if j == k {
                    State::GuestKernel
                } else {
                    State::Steal
                };
                for i in 1..=OWN {
                    let b = ((100 * j + i - start) / bin_ticks) as usize;
                    *want[b].entry(st).or_default() += 1;
                }
            }
            assert_eq!(row.bins, want, "vCPU {k}");
        }
        // The report's steal agrees: per vCPU, the later vCPUs of the same pCPU.
        let vm0 = report.vms.iter().find(|v| v.id == 0).unwrap();
        let steal: u64 = vm0
            .table
            .rows
            .iter()
            .filter(|r| r.function == "[steal]")
            .map(|r| r.samples)
            .sum();
        let later: usize = (0..8).map(|k| (k + 2..K).step_by(2).count()).sum();
        assert_eq!(steal, OWN * later as u64);
    }
}
