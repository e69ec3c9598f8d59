//! `hvprof-analyze top`: a live terminal view of a stream (ratatui with crossterm), refreshed
//! every second like `perf top`, over the last N seconds of host time ([`crate::live::window`]): the host
//! level (each VM, the hypervisor's functions, `[idle]`), each VM's hottest guest functions (a
//! Linux guest's per process), each vCPU's idle and steal (exact, from the scheduling events),
//! and what was lost so far.
//! [`draw`] renders a [`Snapshot`] into a frame (tests render into ratatui's `TestBackend`);
//! [`run`] reads the source, keeps the terminal (`q`, Esc or Ctrl-C quit), or with `batch`
//! prints each screen as text instead.
//!
//! With `--call-graph` ([`TopOptions::call_graph`]) the tables rank functions by their children
//! share, like `perf top -g`: the samples whose call chain holds the function (once each, its
//! own samples included), beside its self share; callers that never are a leaf get rows too.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::Frame;
use ratatui::backend::TestBackend;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};

use hvprof_samplelog::StreamDecoder;

use crate::live::source::{Chunk, Reader};
use crate::live::window::{Live, Snapshot, grouped};
use crate::naming::namer::Namer;
use crate::naming::symbols::Images;

/// How often the screen is refreshed.
pub const REFRESH: Duration = Duration::from_secs(1);
/// Rows a snapshot keeps per table (the screen shows what fits).
const ROWS: usize = 60;

/// `hog 45.0% sleeper 7.5%`: who held a vCPU's pCPU in its steal (percent of the window).
fn steal_by(by: &[(String, f64)]) -> String {
    by.iter()
        .filter(|(_, f)| *f >= 0.0005)
        .map(|(n, f)| format!("{n} {:.1}%", 100.0 * f))
        .collect::<Vec<_>>()
        .join(" ")
}

fn percent(p: f64) -> String {
    format!("{p:5.1}%")
}

/// Renders `s` into the frame: three lines of figures, the host level beside the vCPUs' time,
/// then each VM's hottest guest functions. `title` names the source.
pub fn draw(f: &mut Frame, s: &Snapshot, title: &str) {
    let area = f.area();
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let middle_rows = s.host.len().max(s.vcpus.len()) as u16 + 3;
    let [head, middle, bottom] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(middle_rows.clamp(5, (area.height / 2).max(5))),
        Constraint::Min(3),
    ])
    .areas(area);
    let t = &s.totals;
    let mut lines = vec![
        Line::from(format!("hvprof top: {title} | q quits")).style(bold),
        Line::from(format!(
            "window: the last {} s of host time ({:.1} s covered, {:.1} s since the first record); vCPU times exact, from the events",
            s.window, s.span, s.elapsed
        )),
    ];
    if s.waiting {
        lines.push(Line::from(
            "waiting for the header frame (its TSC frequency places the records in host time)",
        ));
    } else {
        lines.push(Line::from(format!(
            "host: VMs {} hypervisor {} idle {} | {} samples in the window, {} samples/s",
            percent(s.vm_percent),
            percent(s.hypervisor_percent),
            percent(s.idle_percent),
            grouped(s.samples),
            grouped(s.rate.round() as u64)
        )));
    }
    lines.push(Line::from(format!(
        "received {} bytes, {} frames, {} samples | lost {} blocks, {} samples; {} ring drops; {} damaged{}",
        grouped(t.bytes),
        grouped(t.frames),
        grouped(t.samples),
        grouped(t.blocks_lost),
        grouped(t.samples_lost),
        grouped(t.ring_drops),
        grouped(t.damaged),
        if t.end_seen { "; end frame" } else { "" }
    )));
    f.render_widget(Paragraph::new(lines), head);

    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(middle);
    // With call graphs a first column: the children share (samples whose stack holds the row).
    let cg = s.call_graph;
    let children = |r: &crate::live::window::Row| {
        cg.then(|| Cell::from(Line::from(percent(r.children_percent)).right_aligned()))
    };
    let with_children = |widths: &[Constraint]| -> Vec<Constraint> {
        cg.then_some(Constraint::Length(9))
            .into_iter()
            .chain(widths.iter().copied())
            .collect()
    };
    // The headings: "%" is the self share, beside the children share.
    let header = |names: &[&'static str]| {
        let children = cg.then_some("children");
        let names = names
            .iter()
            .map(|&n| if cg && n == "%" { "self" } else { n });
        Row::new(children.into_iter().chain(names)).style(bold)
    };
    let host_rows = s.host.iter().map(|r| {
        Row::new(children(r).into_iter().chain([
            Cell::from(Line::from(percent(r.percent)).right_aligned()),
            Cell::from(Line::from(grouped(r.samples)).right_aligned()),
            Cell::from(r.name.clone()),
            Cell::from(r.module.clone()),
        ]))
    });
    let widths = with_children(&[
        Constraint::Length(6),
        Constraint::Length(9),
        Constraint::Min(16),
        Constraint::Length(10),
    ]);
    f.render_widget(
        Table::new(host_rows, widths)
            .header(header(&["%", "samples", "host level", "module"]))
            .block(Block::bordered().title(if cg {
                "Host level (% of the window's samples; children: with callees)"
            } else {
                "Host level (% of the window's samples)"
            })),
        left,
    );
    let vcpu_rows = s.vcpus.iter().map(|v| {
        Row::new([
            Cell::from(v.name.clone()),
            Cell::from(Line::from(v.vcpu.to_string()).right_aligned()),
            Cell::from(Line::from(percent(100.0 * v.running)).right_aligned()),
            Cell::from(Line::from(percent(100.0 * v.idle)).right_aligned()),
            Cell::from(Line::from(percent(100.0 * v.steal)).right_aligned()),
            Cell::from(steal_by(&v.steal_by)),
        ])
    });
    let name = s
        .vcpus
        .iter()
        .map(|v| v.name.len())
        .max()
        .unwrap_or(0)
        .clamp(2, 16);
    let widths = [
        Constraint::Length(name as u16),
        Constraint::Length(4),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Min(12),
    ];
    f.render_widget(
        Table::new(vcpu_rows, widths)
            .header(Row::new(["VM", "vCPU", "running", "idle", "steal", "steal by"]).style(bold))
            .block(
                Block::bordered().title(
                    "vCPU time (idle: out halted; steal: out runnable, by who held its pCPU)",
                ),
            ),
        right,
    );

    // The rows that fit, shared among the VMs (each has its heading row). A Linux guest's
    // functions are per process: a process column then follows the module.
    let processes = s
        .vms
        .iter()
        .flat_map(|v| &v.rows)
        .any(|r| r.process.is_some());
    let process_cell = |r: Option<&crate::live::window::Row>| {
        processes.then(|| Cell::from(r.and_then(|r| r.process.clone()).unwrap_or_default()))
    };
    let fit = usize::from(bottom.height.saturating_sub(3));
    let n = s.vms.len().max(1);
    let budget = fit.saturating_sub(s.vms.len());
    let mut rows = Vec::new();
    for (i, vm) in s.vms.iter().enumerate() {
        let per_vm = (budget / n + usize::from(i < budget % n)).max(1);
        rows.push(
            Row::new(
                cg.then(|| Cell::from(Line::from(percent(vm.percent)).right_aligned()))
                    .into_iter()
                    .chain([
                        Cell::from(Line::from(percent(vm.percent)).right_aligned()),
                        Cell::from(Line::from(grouped(vm.samples)).right_aligned()),
                        Cell::from(format!("[{}] (vm {})", vm.name, vm.vm)),
                        Cell::from(""),
                    ])
                    .chain(process_cell(None)),
            )
            .style(bold),
        );
        for r in vm.rows.iter().take(per_vm) {
            rows.push(Row::new(
                children(r)
                    .into_iter()
                    .chain([
                        Cell::from(Line::from(percent(r.percent)).right_aligned()),
                        Cell::from(Line::from(grouped(r.samples)).right_aligned()),
                        Cell::from(format!("  {}", r.name)),
                        Cell::from(r.module.clone()),
                    ])
                    .chain(process_cell(Some(r))),
            ));
        }
    }
    let mut widths = with_children(&[
        Constraint::Length(6),
        Constraint::Length(9),
        Constraint::Min(30),
        Constraint::Length(24),
    ]);
    let mut headings = vec!["%", "samples", "function", "module"];
    if processes {
        widths.push(Constraint::Length(20));
        headings.push("process");
    }
    f.render_widget(
        Table::new(rows, widths)
            .header(header(&headings))
            .block(Block::bordered().title(
                "Hottest guest functions per VM (a VM: % of the window's samples; a function: % of its VM's)",
            )),
        bottom,
    );
}

/// `s` drawn on a `width` × `height` screen, as text (one line per row, trailing blanks cut).
pub fn render_text(s: &Snapshot, title: &str, width: u16, height: u16) -> Result<String> {
    let mut term = ratatui::Terminal::new(TestBackend::new(width, height))?;
    term.draw(|f| draw(f, s, title))?;
    Ok(buffer_text(term.backend().buffer()))
}

/// A buffer's text, one line per row, trailing blanks cut.
pub fn buffer_text(buf: &ratatui::buffer::Buffer) -> String {
    let area = buf.area;
    let mut out = String::new();
    for y in area.top()..area.bottom() {
        let mut line = String::new();
        for x in area.left()..area.right() {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// How `top` runs.
pub struct TopOptions {
    /// The window, in seconds.
    pub window: u64,
    /// What the title line names.
    pub title: String,
    /// Print each screen as text on `out` instead of keeping the terminal, and stop when the
    /// source ends (or after `idle_timeout` without a byte).
    pub batch: Option<(u16, u16)>,
    /// See `batch`.
    pub idle_timeout: Option<Duration>,
    /// Count each sample with its call chain: the tables get a children column and are ranked
    /// by it.
    pub call_graph: bool,
}

/// Restores the terminal when dropped (errors and early returns; panics have ratatui's hook).
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// The stream's decoding, the window, and the namer kept up to date.
struct View<'a> {
    images: &'a Images,
    dec: StreamDecoder,
    live: Live,
    namer: Option<(u64, Namer<'a>)>,
}

impl<'a> View<'a> {
    fn feed(&mut self, bytes: &[u8]) {
        self.live.add_bytes(bytes.len() as u64);
        let live = &mut self.live;
        self.dec.feed(bytes, &mut |item| live.push(item));
    }

    fn snapshot(&mut self) -> Snapshot {
        let version = self.live.naming_version();
        if self.namer.as_ref().is_none_or(|(v, _)| *v != version) {
            // Warnings (symbols missing) stay unsaid here: `report` says them.
            let mut warnings = Vec::new();
            self.namer = Some((version, self.live.namer(self.images, &mut warnings)));
        }
        let (_, namer) = self.namer.as_ref().expect("made above");
        self.live.snapshot(namer, ROWS)
    }
}

/// Shows `reader`'s stream until `q`, Esc or Ctrl-C (or `interrupted`); in batch mode prints a
/// screen on `out` every second and the last one when the source ends.
pub fn run(
    reader: &Reader,
    images: &Images,
    options: &TopOptions,
    interrupted: &AtomicBool,
    out: &mut dyn Write,
) -> Result<()> {
    let mut view = View {
        images,
        dec: StreamDecoder::new(),
        live: if options.call_graph {
            Live::with_call_graph(options.window)
        } else {
            Live::new(options.window)
        },
        namer: None,
    };
    if let Some((width, height)) = options.batch {
        return run_batch(
            reader,
            &mut view,
            options,
            (width, height),
            interrupted,
            out,
        );
    }
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() {
        bail!("top needs a terminal on standard output (or --batch)");
    }
    let mut term = ratatui::try_init().context("cannot set up the terminal")?;
    let _restore = Restore;
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| watch_terminal(interrupted, &done));
        let shown = show(reader, &mut view, options, interrupted, &mut term);
        done.store(true, Ordering::Relaxed);
        shown
    })
}

/// Ends the process when a termination signal arrives (`interrupted`: Ctrl-C, SIGTERM, SIGHUP)
/// or the terminal goes away (a hangup on it), whatever the view is doing, until `done`. Once
/// its terminal is gone, crossterm's reader gets end-of-file at every read and loops on it inside
/// `event::read`, which then never returns: the view's own loop would spin there for ever.
fn watch_terminal(interrupted: &AtomicBool, done: &AtomicBool) {
    use std::os::fd::AsRawFd;
    // The terminal crossterm reads: standard input when it is one, else /dev/tty.
    let tty = std::fs::File::open("/dev/tty").ok();
    let fd = if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        std::io::stdin().as_raw_fd()
    } else {
        match &tty {
            Some(t) => t.as_raw_fd(),
            None => -1,
        }
    };
    while !done.load(Ordering::Relaxed) {
        let hung_up = fd >= 0 && {
            let mut p = libc::pollfd {
                fd,
                events: 0,
                revents: 0,
            };
            // SAFETY: one valid pollfd, a zero timeout; `fd` stays open while this runs (standard
            // input, or `tty` above).
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
        };
        if hung_up {
            // No terminal left to restore. 129: as a shell reports a hangup.
            std::process::exit(129);
        }
        if interrupted.load(Ordering::Relaxed) {
            // The terminal back as it was, written straight to it: standard output's lock may
            // be held by the view, which is stuck or busy. 130: as a shell reports Ctrl-C.
            let _ = crossterm::terminal::disable_raw_mode();
            let leave = b"\x1b[?1049l\x1b[?25h";
            // SAFETY: writes `leave`'s bytes from a live buffer to standard output's descriptor.
            let _ = unsafe { libc::write(1, leave.as_ptr().cast(), leave.len()) };
            std::process::exit(130);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The live view on the terminal, until `q`, Esc, Ctrl-C or `interrupted`.
fn show(
    reader: &Reader,
    view: &mut View<'_>,
    options: &TopOptions,
    interrupted: &AtomicBool,
    term: &mut ratatui::DefaultTerminal,
) -> Result<()> {
    let mut next = Instant::now();
    let mut ended: Option<String> = None;
    loop {
        if interrupted.load(Ordering::Relaxed) {
            return Ok(());
        }
        let now = Instant::now();
        let wait = next
            .saturating_duration_since(now)
            .min(Duration::from_millis(50));
        if ended.is_none() {
            match reader.recv_timeout(wait) {
                Some(Chunk::Data(d)) => view.feed(&d),
                Some(Chunk::End) => ended = Some("the source ended".into()),
                Some(Chunk::Failed(e)) => ended = Some(format!("reading failed: {e}")),
                None => {}
            }
        }
        let mut redraw = false;
        let key_wait = if ended.is_some() {
            wait
        } else {
            Duration::ZERO
        };
        while event::poll(key_wait)? {
            match event::read()? {
                Event::Key(k) if k.kind != KeyEventKind::Release => {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) {
                        return Ok(());
                    }
                }
                Event::Resize(..) => redraw = true,
                _ => {}
            }
            if ended.is_some() {
                break;
            }
        }
        if redraw || Instant::now() >= next {
            let s = view.snapshot();
            let title = match &ended {
                Some(why) => format!("{} ({why})", options.title),
                None => options.title.clone(),
            };
            term.draw(|f| draw(f, &s, &title))?;
            next = Instant::now() + REFRESH;
        }
    }
}

fn run_batch(
    reader: &Reader,
    view: &mut View<'_>,
    options: &TopOptions,
    (width, height): (u16, u16),
    interrupted: &AtomicBool,
    out: &mut dyn Write,
) -> Result<()> {
    let start = Instant::now();
    let mut next = start + REFRESH;
    let mut last_data = start;
    let why = loop {
        if interrupted.load(Ordering::Relaxed) {
            break "interrupted".to_owned();
        }
        let now = Instant::now();
        match reader.recv_timeout(next.saturating_duration_since(now)) {
            Some(Chunk::Data(d)) => {
                view.feed(&d);
                last_data = Instant::now();
            }
            Some(Chunk::End) => break "the source ended".to_owned(),
            Some(Chunk::Failed(e)) => break format!("reading failed: {e}"),
            None => {}
        }
        if let Some(idle) = options.idle_timeout
            && last_data.elapsed() >= idle
        {
            break format!("nothing arrived for {:.1} s", idle.as_secs_f64());
        }
        if Instant::now() >= next {
            let s = view.snapshot();
            writeln!(out, "{}", render_text(&s, &options.title, width, height)?)?;
            out.flush()?;
            next = Instant::now() + REFRESH;
        }
    };
    view.dec.finish(&mut |item| view.live.push(item));
    let s = view.snapshot();
    let title = format!("{} ({why})", options.title);
    write!(out, "{}", render_text(&s, &title, width, height)?)?;
    out.flush()?;
    Ok(())
}
