//! One self-contained HTML page: the capture's figures, the timeline and the flame graph (inline
//! SVG), the report's tables (host level, every VM and vCPU), the call graph (a capture with call
//! chains) and the exit statistics. No script, no external resource: it opens from a file,
//! offline.

use std::fmt::Write;

use anyhow::Result;

use crate::model::profile::Profile;
use crate::views::callgraph::CallGraph;
use crate::views::chart::Timeline;
use crate::views::report::{Level, Report, Section, cells};
use crate::views::stat::{SampledTable, Stat};

/// Escapes text for HTML.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            // Control characters are not allowed in HTML text (nor in the inline SVG's XML).
            c if c.is_control() && c != '\n' => {
                o.push_str(&crate::naming::escape::printable(&c.to_string()))
            }
            c => o.push(c),
        }
    }
    o
}

/// The `<svg>` element of an SVG document (without the XML declaration and doctype), without
/// the `onload` handler inferno leaves when it writes no script (it would call a function that
/// is not there).
fn inline_svg(doc: &str) -> String {
    let svg = doc.find("<svg").map_or(doc, |i| &doc[i..]);
    svg.replacen(" onload=\"init(evt)\"", "", 1)
}

fn rows_table(out: &mut String, s: &Section, top: usize) {
    let rows = s.rows;
    let (header, body) = cells(rows, s.processes, top);
    out.push_str("<table><thead><tr>");
    for h in header {
        let _ = write!(out, "<th>{h}</th>");
    }
    out.push_str("</tr></thead><tbody>\n");
    for row in &body {
        out.push_str("<tr>");
        for (c, cell) in row.iter().enumerate() {
            // Samples and %Ratio are numbers, right-aligned.
            let class = if c < 2 { " class=n" } else { "" };
            let _ = write!(out, "<td{class}>{}</td>", esc(cell));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table>\n");
    if let Some(more) = s.more_rows(top) {
        let _ = writeln!(out, "<p class=note>… {more} more rows</p>");
    }
}

/// A section of the report: its title, its figures, its rows.
fn section(out: &mut String, s: &Section, top: usize) {
    match s.level {
        Level::Host => {
            let _ = writeln!(
                out,
                "<h2 id=host>{}</h2><p>{} &nbsp; {}</p>",
                esc(&s.title),
                s.total,
                s.split
            );
        }
        Level::Vm | Level::Vcpu => {
            let _ = writeln!(
                out,
                "<h3>{}</h3><p>{} &nbsp; {}</p>",
                esc(&s.title),
                s.total,
                s.split
            );
        }
    }
    if let Some(e) = &s.exact {
        let _ = writeln!(out, "<p>{e}</p>");
    }
    for line in [&s.steal_by, &s.pause_loop, &s.vpmu].into_iter().flatten() {
        let _ = writeln!(out, "<p>{}</p>", esc(line));
    }
    rows_table(out, s, top);
    if s.level == Level::Host {
        out.push_str("<h2 id=guests>Guest level</h2>\n");
    }
}

/// The call graph: per level its functions by children, with self; the exit causes; the cut
/// chains (`crate::views::callgraph`).
fn call_graph_section(out: &mut String, g: &CallGraph, top: usize) {
    out.push_str("<h2 id=calls>Call graph</h2>\n<p class=note>Children: the samples whose stack holds the function; Self: those whose leaf it is (as perf report --children). Host level: every sample as the pCPUs saw it (a guest sample is its VM); VM level: its guest samples with their guest callers.</p>\n");
    let pct = |n: u64, total: u64| {
        if total == 0 {
            0.0
        } else {
            100.0 * n as f64 / total as f64
        }
    };
    for l in &g.levels {
        let title = if l.level == "host" {
            "Host level".to_owned()
        } else {
            format!("VM {}", l.level)
        };
        let _ = writeln!(out, "<h3>{}</h3><p>{} samples</p>", esc(&title), l.samples);
        out.push_str("<table><thead><tr><th>Children</th><th>Self</th><th>Function</th><th>Callers</th></tr></thead><tbody>\n");
        let fs: Vec<_> = g.functions.iter().filter(|f| f.level == l.level).collect();
        for f in fs.iter().take(top) {
            let callers: Vec<String> = g
                .edges
                .iter()
                .filter(|e| e.level == l.level && e.callee == f.function)
                .take(3)
                .map(|e| format!("{} ({:.2}%)", e.caller, pct(e.samples, l.samples)))
                .collect();
            let _ = writeln!(
                out,
                "<tr><td class=n>{:.2}%</td><td class=n>{:.2}%</td><td>{}</td><td>{}</td></tr>",
                pct(f.total, l.samples),
                pct(f.self_samples, l.samples),
                esc(&f.function),
                esc(&callers.join(", "))
            );
        }
        out.push_str("</tbody></table>\n");
        if fs.len() > top {
            let _ = writeln!(out, "<p class=note>… {} more functions</p>", fs.len() - top);
        }
    }
    if !g.exit_causes.is_empty() {
        let host = g.levels.first().map_or(0, |l| l.samples);
        out.push_str("<h3>Exit causes</h3><p class=note>The guest code at the exits whose handling the hypervisor's samples caught: the function at the exit's RIP and its caller.</p>\n<table><thead><tr><th>VM</th><th>Samples</th><th>%Host</th><th>Exit</th><th>Guest function</th><th>Caller</th></tr></thead><tbody>\n");
        for c in g.exit_causes.iter().take(top) {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td class=n>{}</td><td class=n>{:.2}%</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&c.vm),
                c.samples,
                pct(c.samples, host),
                esc(&c.exit_reason),
                esc(&c.guest_function),
                esc(c.guest_caller.as_deref().unwrap_or("–"))
            );
        }
        out.push_str("</tbody></table>\n");
    }
    let _ = writeln!(
        out,
        "<p class=note>Cut chains: {} samples at the walker's depth limit, {} at a bad frame (their outermost frame is [truncated: ...]).</p>",
        g.truncated.depth_limit, g.truncated.bad_frame
    );
}

fn sampled_table(out: &mut String, title: &str, t: &SampledTable) {
    let _ = writeln!(
        out,
        "<h4>{}</h4><p>{} hypervisor samples on its exits, {} guest samples ({:.2}% hypervisor)</p>",
        esc(title),
        t.hypervisor_samples,
        t.guest_samples,
        t.hypervisor_percent
    );
    if t.reasons.is_empty() {
        return;
    }
    out.push_str("<table><thead><tr><th>VM-EXIT</th><th>Samples</th><th>Samples%</th><th>Time (ticks) ± stddev</th><th>Per exit ± stddev</th></tr></thead><tbody>\n");
    for r in &t.reasons {
        let per = match (r.per_exit_ticks, r.per_exit_stddev_ticks) {
            (Some(m), Some(s)) => format!("{m:.1} ± {s:.1}"),
            _ => "–".into(),
        };
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=n>{}</td><td class=n>{:.2}%</td><td class=n>{} ± {:.0}</td><td class=n>{}</td></tr>",
            esc(&r.reason),
            r.samples,
            r.percent,
            r.time_ticks,
            r.time_stddev_ticks,
            per
        );
    }
    out.push_str("</tbody></table>\n");
}

fn stat_section(out: &mut String, s: &Stat) {
    out.push_str("<h2 id=stat>Exit statistics</h2>\n");
    for vm in &s.vms {
        let _ = writeln!(out, "<h3>VM {} (vm {})</h3>", esc(&vm.name), vm.id);
        match &vm.exact {
            Some(e) => {
                let _ = writeln!(
                    out,
                    "<h4>Exact, from the hypervisor's exit table: {} exits (handler cost, TSC ticks)</h4>",
                    e.exits
                );
                out.push_str("<table><thead><tr><th>VM-EXIT</th><th>Samples</th><th>Samples%</th><th>Time%</th><th>Min</th><th>Max</th><th>Avg time ± stddev (bound)</th></tr></thead><tbody>\n");
                for r in &e.reasons {
                    let _ = writeln!(
                        out,
                        "<tr><td>{}</td><td class=n>{}</td><td class=n>{:.2}%</td><td class=n>{:.2}%</td><td class=n>{}</td><td class=n>{}</td><td class=n>{:.1} ± ≤{:.1}</td></tr>",
                        esc(&r.reason),
                        r.count,
                        r.count_percent,
                        r.time_percent,
                        r.min_ticks,
                        r.max_ticks,
                        r.mean_ticks,
                        r.stddev_bound_ticks
                    );
                }
                out.push_str("</tbody></table>\n");
            }
            None => {
                out.push_str("<p class=note>Exact: no exit table on the console for this VM.</p>\n")
            }
        }
        sampled_table(out, "Estimated, from the samples (VM)", &vm.estimated);
        if vm.vcpus.len() > 1 {
            for c in &vm.vcpus {
                sampled_table(
                    out,
                    &format!("Estimated, from the samples (vCPU {})", c.vcpu),
                    &c.estimated,
                );
            }
        }
    }
    for n in &s.notes {
        let _ = writeln!(out, "<p class=note>{}</p>", esc(n));
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em;color:#222;max-width:1250px}\
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;margin-top:1.6em}\
table{border-collapse:collapse;margin:.4em 0 1em;font-size:.9em}\
th,td{padding:.15em .6em;border-bottom:1px solid #eee;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}\
.note{color:#666;font-size:.85em}.warn{color:#a40}\
figure{margin:0;overflow-x:auto}svg{max-width:100%;height:auto}\
nav a{margin-right:1em}";

/// Renders the page: `r` is `p`'s report.
/// Who stole from whom: a row per VM that lost its pCPU to another (its `[steal] (outside)`
/// by who held it, `GuestTable::steal_by`), a column per culprit, cells in % of the row VM's
/// samples. Nothing when no VM lost its pCPU to anyone.
fn steal_matrix(out: &mut String, r: &Report) {
    // The VMs in the report's order, then no one and the hypervisor.
    let named = |n: &str| {
        r.vms
            .iter()
            .any(|v| v.table.steal_by.iter().any(|b| b.name == n))
    };
    let mut culprits: Vec<&str> = r
        .vms
        .iter()
        .map(|v| v.name.as_str())
        .filter(|n| named(n))
        .collect();
    for v in &r.vms {
        for b in &v.table.steal_by {
            if !culprits.contains(&b.name.as_str()) {
                culprits.push(&b.name);
            }
        }
    }
    if culprits.is_empty() {
        return;
    }
    out.push_str("<h2 id=stolen>Who stole from whom</h2>\n<p class=note>Each VM's [steal] (outside) by who held its pCPU meanwhile (% of the VM's samples): another VM (its guest, or the hypervisor handling its exits), no one (the pCPU idle while the VM was runnable), or the hypervisor finishing the VM's own exit.</p>\n<table><tr><th>VM \\ held by</th>");
    for c in &culprits {
        let _ = write!(out, "<th>{}</th>", esc(c));
    }
    out.push_str("<th>steal (outside)</th></tr>\n");
    for v in r.vms.iter().filter(|v| !v.table.steal_by.is_empty()) {
        let _ = write!(out, "<tr><td>{}</td>", esc(&v.name));
        let mut total = 0.0;
        for c in &culprits {
            let share = v
                .table
                .steal_by
                .iter()
                .filter(|b| b.name == *c)
                .fold(0.0, |sum, b| sum + b.percent);
            total += share;
            let _ = write!(out, "<td class=n>{share:.2}</td>");
        }
        let _ = writeln!(out, "<td class=n>{total:.2}</td></tr>");
    }
    out.push_str("</table>\n");
}

/// Per pCPU, who stole from whom (each vCPU's steal there by the VM that held the pCPU), and
/// per vCPU what its pCPU's holders ran (`report --stolen`).
fn stolen_section(out: &mut String, s: &crate::views::stolen::Stolen, top: usize) {
    if s.pcpus.is_empty() {
        return;
    }
    for c in &s.pcpus {
        let _ = write!(
            out,
            "<h3>Who stole from whom on pCPU {}</h3>\n<p class=note>Each vCPU's steal on this pCPU (samples while it was out and runnable) by who held the pCPU, % of the row's steal samples here.</p>\n<table><tr><th>vCPU \\ held by</th>",
            c.pcpu
        );
        for h in &c.holders {
            let _ = write!(out, "<th>{}</th>", esc(h));
        }
        out.push_str("</tr>\n");
        for v in &c.victims {
            let _ = write!(out, "<tr><td>{}</td>", esc(v));
            for h in &c.holders {
                let _ = write!(out, "<td class=n>{:.2}</td>", c.share(v, h));
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</table>\n");
    }
    for v in &s.vcpus {
        let _ = write!(
            out,
            "<h3>What held VM {} vCPU {}'s pCPU in its steal</h3>\n<table><tr><th>%Steal</th><th>Samples</th><th>Held by</th><th>Function</th><th>Module</th><th>Process</th></tr>\n",
            esc(&v.vm),
            v.vcpu
        );
        for r in v.rows.iter().take(top) {
            let _ = writeln!(
                out,
                "<tr><td class=n>{:.2}</td><td class=n>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                r.percent,
                r.samples,
                esc(&r.holder),
                esc(&r.function),
                esc(&r.module),
                esc(&r.process)
            );
        }
        out.push_str("</table>\n");
    }
}

pub fn render(p: &Profile, r: &Report, source: &str, bins: usize, top: usize) -> Result<String> {
    let timeline = Timeline::build(p, bins)?.svg(&format!("Timeline: {source}"))?;
    let mut flame = Vec::new();
    crate::views::flame::write(p, &format!("Flame graph: {source}"), false, &mut flame)?;
    // Its style sheet would apply to the whole page: keep it to the flame graph.
    let flame = inline_svg(&String::from_utf8_lossy(&flame))
        .replacen("<svg ", "<svg class=\"flame\" ", 1)
        .replacen("\ntext {", "\nsvg.flame text {", 1);
    let stat = crate::views::stat::build(p);
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>\
         <meta name=viewport content=\"width=device-width, initial-scale=1\">\
         <title>hvprof: {}</title><style>{STYLE}</style></head><body>\n",
        esc(source)
    );
    let _ = writeln!(out, "<h1>hvprof profile: {}</h1>", esc(source));
    // Warnings first: where records were lost (also drawn over the timeline), integrity.
    for w in &r.warnings {
        let _ = writeln!(out, "<p class=warn>warning: {}</p>", esc(w));
    }
    let calls = p
        .samples
        .has_chains()
        .then(|| crate::views::callgraph::build(p));
    out.push_str("<nav><a href=#timeline>Timeline</a><a href=#flame>Flame graph</a><a href=#host>Host level</a><a href=#guests>Guest level</a>");
    if r.vms.iter().any(|v| !v.table.steal_by.is_empty()) {
        out.push_str("<a href=#stolen>Who stole</a>");
    }
    if calls.is_some() {
        out.push_str("<a href=#calls>Call graph</a>");
    }
    out.push_str("<a href=#stat>Exit statistics</a></nav>\n");
    let (start, end) = p.span();
    let _ = writeln!(
        out,
        "<p>{} samples and {} scheduling events from {} pCPU(s), {} source, period {} TSC ticks, TSC {} Hz, {:.3} s of host time. \
         Sample path cost: mean {:.1}, min {}, max {} ticks ({:.2}% of the period).</p>",
        r.total_samples,
        r.events,
        r.pcpus,
        r.source,
        r.period_ticks,
        r.tsc_hz,
        p.seconds(end) - p.seconds(start),
        r.cost.mean,
        r.cost.min,
        r.cost.max,
        r.cost.percent_of_period
    );
    let _ = writeln!(out, "<p>{}</p>", esc(&r.lost.line()));
    let _ = writeln!(
        out,
        "<h2 id=timeline>Timeline</h2><p class=note>Stacked bars over host time: per pCPU its samples, each VM's guest in a colour of its own (who held the pCPU), per vCPU its virtual stream (steal: another VM or vCPU held its pCPU; hypervisor: the work on its exits, by exit reason). Red bands over a pCPU: records lost.</p><figure>{}</figure>",
        inline_svg(&timeline)
    );
    let _ = writeln!(
        out,
        "<h2 id=flame>Flame graph</h2><p class=note>{}. Hover a frame for its samples.</p><figure>{}</figure>",
        if calls.is_some() {
            "VM; process; callers; function (samples without call chains: VM; process; module; function)"
        } else {
            "VM; process; module; function"
        },
        flame
    );
    for s in r.sections(None) {
        section(&mut out, &s, top);
    }
    steal_matrix(&mut out, r);
    stolen_section(&mut out, &crate::views::stolen::build(p)?, top);
    if let Some(g) = &calls {
        call_graph_section(&mut out, g, top);
    }
    stat_section(&mut out, &stat);
    out.push_str("<p class=note>Made by hvprof-analyze.</p>\n</body></html>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc("<a href=\"x\">&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn inline_svg_drops_the_prolog_and_the_handler() {
        assert_eq!(
            inline_svg("<?xml version=\"1.0\"?><!DOCTYPE svg><svg a=1 onload=\"init(evt)\"></svg>"),
            "<svg a=1></svg>"
        );
    }
}
