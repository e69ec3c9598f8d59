//! The timeline: stacked bars over host time (plotters, SVG), one row per pCPU and one per
//! vCPU. Each bar is one time bin; its segments are the shares of the row's samples in that bin
//! by state: guest user, guest kernel, hypervisor by exit reason (and for no VM), idle, and for
//! vCPU rows steal.
//!
//! A pCPU row holds that pCPU's samples. A vCPU row holds its virtual sample stream on the host
//! time axis (`timeline::classify`, the report's `[steal]`/`[idle]` slots): its own samples as
//! guest user/kernel, the hypervisor's work on its exits while it was in by exit reason (the
//! report's `[steal] (hypervisor)`), the scheduler's work while it was out as "hypervisor: no VM",
//! halted slots as idle, and every other slot while it was out (another VM or vCPU held its
//! pCPU) as steal.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use plotters::prelude::*;
use rustc_hash::FxHashMap as HashMap;

use hvprof_samplelog::{NO_EXIT, NO_VM};

use crate::naming::exit_name;
use crate::profile::{Profile, Sampled, What};
use crate::timeline::{Owner, Slot, classify};

/// The state of one slot of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    GuestUser,
    GuestKernel,
    /// The hypervisor on a vCPU's exit (its last exit reason).
    Hypervisor(u16),
    /// The hypervisor for no VM (the scheduler, the export).
    HypervisorNoVm,
    Idle,
    Steal,
}

impl State {
    pub fn label(self) -> String {
        match self {
            State::GuestUser => "guest user".into(),
            State::GuestKernel => "guest kernel".into(),
            State::Hypervisor(NO_EXIT) => "hypervisor: no exit yet".into(),
            State::Hypervisor(r) => format!("hypervisor: {}", exit_name(r)),
            State::HypervisorNoVm => "hypervisor: no VM".into(),
            State::Idle => "idle".into(),
            State::Steal => "steal".into(),
        }
    }

    /// A pCPU sample's state.
    pub fn of(s: &Sampled) -> State {
        match s.what {
            What::GuestUser => State::GuestUser,
            What::GuestKernel => State::GuestKernel,
            What::Hypervisor if s.vm == NO_VM => State::HypervisorNoVm,
            What::Hypervisor => State::Hypervisor(s.exit),
            What::Idle => State::Idle,
        }
    }
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
}

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
                State::GuestUser => RGBColor(44, 160, 44),
                State::GuestKernel => RGBColor(31, 119, 180),
                State::HypervisorNoVm => RGBColor(110, 110, 110),
                State::Idle => RGBColor(205, 205, 205),
                State::Steal => RGBColor(214, 39, 40),
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

impl Timeline {
    /// Bins a profile's samples into `bins` bars per row.
    pub fn build(p: &Profile, bins: usize) -> Timeline {
        let bins = bins.max(1);
        let (start, end) = p.span();
        let bin_ticks = ((end - start) / bins as u64 + 1).max(1);
        let bin = |tsc: u64| (((tsc - start) / bin_ticks) as usize).min(bins - 1);
        let mut rows = Vec::new();
        let mut totals: HashMap<State, u64> = HashMap::default();
        // pCPU rows.
        let pcpus = p.pcpu_list();
        let mut per_pcpu: HashMap<u16, Vec<usize>> = HashMap::default();
        for (i, s) in p.samples.iter().enumerate() {
            per_pcpu.entry(s.pcpu).or_default().push(i);
        }
        for &c in &pcpus {
            let mut row = Row {
                label: format!("pCPU {c}"),
                bins: vec![HashMap::default(); bins],
            };
            for &i in &per_pcpu[&c] {
                let s = &p.samples[i];
                let st = State::of(s);
                *row.bins[bin(s.tsc)].entry(st).or_default() += 1;
                *totals.entry(st).or_default() += 1;
            }
            rows.push(row);
        }
        // vCPU rows, from their virtual streams.
        let lists: HashMap<u16, Vec<(u64, Owner)>> = per_pcpu
            .iter()
            .map(|(&c, idx)| {
                (
                    c,
                    idx.iter()
                        .map(|&i| (p.samples[i].tsc, p.samples[i].owner()))
                        .collect(),
                )
            })
            .collect();
        let mut vrows: HashMap<(u16, u16), Vec<HashMap<State, u64>>> = HashMap::default();
        if !p.events.is_empty() {
            classify(&lists, &p.events, |key, pcpu, i, slot| {
                let s = &p.samples[per_pcpu[&pcpu][i]];
                let st = match slot {
                    Slot::Own | Slot::Hypervisor => State::of(s),
                    Slot::Idle => State::Idle,
                    Slot::HypervisorOut => State::HypervisorNoVm,
                    Slot::StealOn(_) | Slot::StealOutside => State::Steal,
                };
                let row = vrows
                    .entry(key)
                    .or_insert_with(|| vec![HashMap::default(); bins]);
                *row[bin(s.tsc)].entry(st).or_default() += 1;
                *totals.entry(st).or_default() += 1;
            });
        } else {
            // No scheduling events: a vCPU's row is its own samples and the hypervisor's on its
            // exits.
            for s in &p.samples {
                if s.vm == NO_VM || s.what == What::Idle {
                    continue;
                }
                let st = State::of(s);
                let row = vrows
                    .entry((s.vm, s.vcpu))
                    .or_insert_with(|| vec![HashMap::default(); bins]);
                *row[bin(s.tsc)].entry(st).or_default() += 1;
                *totals.entry(st).or_default() += 1;
            }
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
        Timeline {
            start,
            bin_ticks,
            ms_per_tick: if p.tsc_hz == 0 {
                1e-6
            } else {
                1e3 / p.tsc_hz as f64
            },
            states: colors(&states, &totals),
            rows,
        }
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
        let legend_rows = self.states.len().div_ceil(legend_cols) as u32;
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
            }
            // The legend: one swatch per state.
            let font = ("sans-serif", 13).into_font().color(&BLACK);
            for (i, (state, color)) in self.states.iter().enumerate() {
                let (col, line) = ((i % legend_cols) as i32, (i / legend_cols) as i32);
                let (x, y) = (60 + col * 280, 10 + line * 24);
                legend
                    .draw(&Rectangle::new([(x, y), (x + 16, y + 14)], color.filled()))
                    .map_err(draw_err)?;
                legend
                    .draw_text(&state.label(), &font, (x + 22, y))
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
                        s.label(),
                        100.0 * n as f64 / total.max(1) as f64
                    ))
                })
                .collect();
            let _ = writeln!(out, "{}: {}", r.label, parts.join(", "));
        }
        out
    }
}

fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotters: {e:?}")
}

/// Writes the timeline SVG of a profile.
pub fn write(p: &Profile, bins: usize, title: &str, out: &mut dyn std::io::Write) -> Result<()> {
    let t = Timeline::build(p, bins);
    out.write_all(t.svg(title)?.as_bytes())
        .context("cannot write the timeline")
}
