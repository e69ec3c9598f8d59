//! The flame graph (inferno): every sample as the stack VM;process;module;function, widths in
//! samples. Guest code sits under its VM and process, the hypervisor's under `[hypervisor]` and
//! whom it worked for, and `[idle]` alone.

use std::io::Write;

use anyhow::{Context, Result};
use inferno::flamegraph::{self, Options};
use rustc_hash::FxHashMap as HashMap;

use crate::profile::Profile;

/// Folded stacks (`a;b;c count`), sorted, one per distinct frame.
pub fn folded(p: &Profile) -> Vec<String> {
    let mut counts: HashMap<u32, u64> = HashMap::default();
    for s in p.samples.stacks() {
        *counts.entry(s.frame).or_default() += s.count;
    }
    let mut by_stack: HashMap<String, u64> = HashMap::default();
    for (frame, n) in counts {
        *by_stack
            .entry(p.frames[frame as usize].folded())
            .or_default() += n;
    }
    let mut lines: Vec<String> = by_stack
        .into_iter()
        .map(|(stack, n)| format!("{stack} {n}"))
        .collect();
    lines.sort();
    lines
}

/// Writes the flame graph SVG. `interactive`: with inferno's JavaScript (search, zoom), for a
/// file of its own; without it for embedding in a page (the frames keep their tooltips).
pub fn write(p: &Profile, title: &str, interactive: bool, out: &mut dyn Write) -> Result<()> {
    let lines = folded(p);
    let mut opts = Options::default();
    opts.title = title.to_owned();
    opts.subtitle = Some(format!(
        "{} samples, {} pCPU(s), period {} ticks; VM;process;module;function",
        p.samples.len(),
        p.pcpus,
        p.period_ticks
    ));
    opts.count_name = "samples".into();
    opts.deterministic = true;
    opts.hash = true;
    opts.no_javascript = !interactive;
    opts.image_width = Some(1200);
    flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), out)
        .context("inferno could not draw the flame graph")
}
