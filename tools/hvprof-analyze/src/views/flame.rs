//! The flame graph (inferno): every sample as the stack VM;process;module;function, widths in
//! samples. Guest code sits under its VM and process, the hypervisor's under `[hypervisor]` and
//! whom it worked for, and `[idle]` alone. Samples the log lost (the loss ranges of the report:
//! blocks lost on the way, ring drops) are one frame `[lost]` as wide as they were.
//!
//! A sample with call chains is its whole stack instead (`whole_stack::whole_stack`):
//! `VM;process;[guest frames];function` for guest code, `[hypervisor];whom;[hypervisor
//! frames];function` for the hypervisor's, `VM;[guest frames];[exit: REASON];[hypervisor
//! frames];function` for the hypervisor's work on a vCPU's exit whose guest chain was walked
//! (its exit cause), `[idle];[hypervisor frames];[idle]`; a cut chain starts at its
//! `[truncated: ...]` frame.

use std::fmt::Write as _;
use std::io::Write;

use anyhow::{Context, Result};
use inferno::flamegraph::{self, Options};
use rustc_hash::FxHashMap as HashMap;

use crate::model::profile::Profile;
use crate::model::whole_stack::{WholeKey, part_name, whole_key, whole_stack};

/// Samples the log lost, over every loss range.
fn lost(p: &Profile) -> u64 {
    p.losses
        .iter()
        .map(crate::model::losses::LossRange::samples_missing)
        .fold(0u64, u64::saturating_add)
}

/// Folded stacks (`a;b;c count`), sorted, one per distinct frame, and `[lost]` for the samples
/// the log lost.
pub fn folded(p: &Profile) -> Vec<String> {
    let mut counts: Vec<u64> = vec![0; p.frames.len()];
    let mut chained: HashMap<WholeKey, (usize, u64)> = HashMap::default();
    for (i, s) in p.samples.stacks().iter().enumerate() {
        if s.calls == 0 {
            counts[s.frame as usize] += s.count;
        } else {
            chained.entry(whole_key(s)).or_insert((i, 0)).1 += s.count;
        }
    }
    let mut by_stack: HashMap<String, u64> = HashMap::default();
    for (frame, &n) in counts.iter().enumerate().filter(|&(_, &n)| n > 0) {
        *by_stack.entry(p.frames[frame].folded()).or_default() += n;
    }
    for (i, n) in chained.into_values() {
        let s = &p.samples.stacks()[i];
        let names: Vec<String> = whole_stack(p, s)
            .unwrap_or_default()
            .iter()
            .map(|part| part_name(p, part).replace(';', ","))
            .collect();
        *by_stack.entry(names.join(";")).or_default() += n;
    }
    let lost = lost(p);
    if lost > 0 {
        *by_stack
            .entry(crate::views::pprof::LOST.to_owned())
            .or_default() += lost;
    }
    let mut lines: Vec<String> = by_stack
        .into_iter()
        .map(|(mut stack, n)| {
            let _ = write!(stack, " {n}");
            stack
        })
        .collect();
    // Distinct lines: an unstable sort orders them as a stable one does.
    lines.sort_unstable();
    lines
}

/// Writes the flame graph SVG. `interactive`: with inferno's JavaScript (search, zoom), for a
/// file of its own; without it for embedding in a page (the frames keep their tooltips).
pub fn write(p: &Profile, title: &str, interactive: bool, out: &mut dyn Write) -> Result<()> {
    let lines = folded(p);
    let mut opts = Options::default();
    opts.title = title.to_owned();
    let lost = lost(p);
    opts.subtitle = Some(format!(
        "{} samples{}, {} pCPU(s), period {} ticks; VM;process;{}function",
        p.samples.len(),
        if lost > 0 {
            format!(" and {lost} lost ([lost])")
        } else {
            String::new()
        },
        p.pcpus,
        p.period_ticks,
        if p.samples.has_chains() {
            "callers;"
        } else {
            "module;"
        }
    ));
    opts.count_name = "samples".into();
    opts.deterministic = true;
    // `folded` sorts them.
    opts.no_sort = true;
    opts.hash = true;
    opts.no_javascript = !interactive;
    opts.image_width = Some(1200);
    flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), out)
        .context("inferno could not draw the flame graph")
}
