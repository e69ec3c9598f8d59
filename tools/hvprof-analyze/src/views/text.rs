//! The report as text: tables in the paper's layout (Samples, %Ratio, Function, Module).

use std::fmt::Write;

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use hvprof_samplelog::{Decoded, PcpuLog, Record};

use crate::naming::escape::printable;
use crate::views::report::{Level, Report, Section, cells};

fn table(section: &Section, top: usize) -> String {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    let (header, body) = cells(section.rows, section.processes, top);
    t.set_header(header);
    for row in body {
        // Names come from the log and the guests' images: escaped (the report already holds
        // them so; this keeps any other source from reaching a terminal raw).
        t.add_row(row.iter().map(|c| printable(c).into_owned()));
    }
    for i in 0..2 {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut s = t.to_string();
    if let Some(more) = section.more_rows(top) {
        let _ = write!(s, "\n  ... {more} more rows (--top)");
    }
    s.push('\n');
    s
}

/// The report as text. It opens with the warnings (where records were lost, integrity, missing
/// names), before any table.
pub fn render(r: &Report, top: usize, only_vm: Option<&str>) -> String {
    let mut out = String::new();
    for w in &r.warnings {
        let _ = writeln!(out, "warning: {}", printable(w));
    }
    if !r.warnings.is_empty() {
        out.push('\n');
    }
    for section in r.sections(only_vm) {
        let title = match section.level {
            Level::Host => format!(
                "Host level ({} pCPU(s), {} source, period {} ticks)",
                r.pcpus, r.source, r.period_ticks
            ),
            Level::Vm | Level::Vcpu => format!("Guest level: {}", printable(&section.title)),
        };
        let _ = writeln!(out, "{title}\n{}   {}", section.total, section.split);
        if let Some(e) = &section.exact {
            let _ = writeln!(out, "{e}");
        }
        for line in [&section.steal_by, &section.pause_loop, &section.vpmu]
            .into_iter()
            .flatten()
        {
            let _ = writeln!(out, "{}", printable(line));
        }
        out.push_str(&table(&section, top));
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "Sample path cost: mean {:.1}, min {}, max {} TSC ticks ({:.2}% of the period)",
        r.cost.mean, r.cost.min, r.cost.max, r.cost.percent_of_period
    );
    if let Some(w) = &r.whole_cost {
        let _ = writeln!(
            out,
            "Profiler's whole cost (measured by the hypervisor): {:.2}% of the pCPUs' time",
            w.percent
        );
        for p in &w.pcpus {
            let _ = write!(
                out,
                "  pCPU {}: {:.2}%: {} sampling exits x {} ticks ({:.2}%), {} timer interrupts x {} ticks ({:.2}%), export {:.2}%",
                p.pcpu,
                p.percent,
                p.sampling_exits,
                p.sampling_exit_mean,
                p.sampling_exit_percent,
                p.timer_interrupts,
                p.timer_interrupt_mean,
                p.timer_percent,
                p.export_percent
            );
            if p.task_reads > 0 {
                let _ = write!(
                    out,
                    "; {} task reads x {} ticks",
                    p.task_reads, p.task_read_mean
                );
            }
            let _ = writeln!(out);
        }
        if let Some(v) = &w.vpmu {
            let _ = writeln!(
                out,
                "  the guests' virtual PMUs: {} exits, {} ticks ({:.2}%)",
                v.exits, v.ticks, v.percent
            );
        }
    }
    let _ = writeln!(out, "{}", r.lost.line());
    out
}

/// What `decode` prints, as a string (see [`write_decode_summary`]; each pCPU's records counted
/// in `d`).
pub fn decode_summary(d: &Decoded, text: bool, records: bool) -> String {
    let mut out = Vec::new();
    let counted = |l: &PcpuLog| l.records.len() as u64;
    // Writing to memory does not fail.
    let _ = write_decode_summary(&mut out, d, &counted, text, records);
    String::from_utf8_lossy(&out).into_owned()
}

/// What `decode` prints, written as it is made: the frames, the header, each pCPU's records
/// (`records_of` counts them: `d` holds none when it was decoded for its description only)
/// and losses, with `records` every record, the other frames, the damage, with `text` the
/// console text.
pub fn write_decode_summary(
    out: &mut dyn std::io::Write,
    d: &Decoded,
    records_of: &dyn Fn(&PcpuLog) -> u64,
    text: bool,
    records: bool,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{} bytes: {} frames ({} header, {} unknown type), {} damaged spans, end frame {}",
        d.bytes,
        d.frames,
        d.header_frames,
        d.unknown_frames,
        d.damaged.len(),
        if d.end_seen() { "seen" } else { "MISSING" }
    )?;
    if let Some(h) = &d.header {
        writeln!(
            out,
            "header: format v{}, build id {}, TSC {} Hz, {} pCPUs, skew {} ticks, period {} ticks, {} VMs",
            h.version,
            crate::naming::symbols::hex(h.build_id.as_bytes()),
            h.tsc_hz,
            h.pcpus,
            h.tsc_skew,
            h.period_ticks,
            h.vms.len()
        )?;
        for v in h.vms.iter() {
            writeln!(
                out,
                "  vm {}: {} ({} vCPUs, image {}, build id {})",
                v.id,
                printable(v.name.as_str()),
                v.vcpus,
                printable(v.image.as_str()),
                crate::naming::symbols::hex(v.image_build_id.as_bytes())
            )?;
        }
    }
    for ((vm, stream), bytes) in &d.output {
        writeln!(
            out,
            "output: vm {vm} {}: {} bytes (hvprof-analyze output)",
            match stream {
                hvprof_samplelog::OutputStream::Stderr => "stderr",
                _ => "stdout",
            },
            bytes.len()
        )?;
    }
    for (vm, lost) in &d.output_lost {
        writeln!(
            out,
            "output: vm {vm}: {lost} bytes lost (the store was full)"
        )?;
    }
    for (pcpu, log) in &d.pcpus {
        writeln!(
            out,
            "pcpu {pcpu}: {} records in {} blocks; lost {} blocks ({} samples, {} events); {} ring drops",
            records_of(log),
            log.blocks_received,
            log.blocks_lost,
            log.samples_lost,
            log.events_lost,
            log.ring_drops
        )?;
        if records {
            for r in &log.records {
                match r {
                    Record::Sample(s) => {
                        writeln!(
                            out,
                            "  {:>16} {:?} vm {} vcpu {} rip {:#x} cr3 {:#x} cpl {} exit {} host {:#x} cost {}",
                            s.tsc,
                            s.kind,
                            s.vm,
                            s.vcpu,
                            s.guest_rip,
                            s.guest_cr3,
                            s.cpl(),
                            s.exit_reason,
                            s.host_rip,
                            s.cost
                        )?;
                    }
                    Record::Event(e) => {
                        writeln!(
                            out,
                            "  {:>16} {:?} vm {} vcpu {} {:?}",
                            e.tsc, e.kind, e.vm, e.vcpu, e.reason
                        )?;
                    }
                }
            }
        }
    }
    writeln!(
        out,
        "{} task frames, {} VM end frames, {} pCPU cost frames, {} mapping frames",
        d.tasks.len(),
        d.vm_ends.len(),
        d.costs.len(),
        d.mappings.len()
    )?;
    for m in &d.mappings {
        writeln!(
            out,
            "  mapping: vm {} {:?} tgid {} cr3 {:#x} {:#x}-{:#x} page {} {} build id {}",
            m.vm,
            m.kind,
            m.tgid,
            m.cr3,
            m.start,
            m.end,
            m.pgoff,
            printable(m.path.as_str()),
            if m.build_id.is_none() {
                "none".to_owned()
            } else {
                crate::naming::symbols::hex(m.build_id.as_bytes())
            }
        )?;
    }
    for dmg in &d.damaged {
        writeln!(out, "damaged: {dmg:?}")?;
    }
    if text {
        out.write_all(b"--- console text ---\n")?;
        // Lines stay lines; every other control character (ESC, ...) is escaped.
        for line in d.text_joined().split_inclusive('\n') {
            let (body, nl) = line.strip_suffix('\n').map_or((line, ""), |b| (b, "\n"));
            out.write_all(printable(body).as_bytes())?;
            out.write_all(nl.as_bytes())?;
        }
    }
    Ok(())
}
