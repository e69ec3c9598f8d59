//! A sample's whole stack, outermost first, with its call chains named ([`whole_stack`]): the
//! one way the flame graph, `perf script`, pprof and the Firefox profile draw it; the call graph
//! counts callers and callees from it.

use std::borrow::Cow;

use crate::model::calls::{exit_frame_name, truncated_name};
use crate::model::profile::Profile;
use crate::model::samples::{ChainEnd, Frame, Stack, What};

/// One frame of a sample's whole stack (see [`whole_stack`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<'a> {
    /// The root: the VM's name (guest samples, exit causes), `[hypervisor]`, `[idle]`.
    Root(Cow<'a, str>),
    /// Whom the sample ran for: the guest process, or (hypervisor samples) `VM: EXIT` or
    /// `no VM`.
    Process(&'a str),
    /// The outermost frame of a cut chain.
    Truncated(ChainEnd),
    /// A frame of a chain (index into `Calls::sites`).
    Site(u32),
    /// Between an exit cause's guest frames and the hypervisor's: the exit's reason.
    Exit(u16),
    /// The sampled function.
    Leaf(&'a Frame),
}

/// A stack with chains laid out outermost first, the one layout of every view:
///
/// - guest sample: VM; process; [guest frames]; leaf;
/// - hypervisor sample: `[hypervisor]`; whom it worked for; [hypervisor frames]; leaf;
/// - hypervisor sample on a vCPU's exit with its guest chain (exit cause): VM; [guest frames];
///   `[exit: REASON]`; [hypervisor frames]; leaf;
/// - idle: `[idle]`; [hypervisor frames]; `[idle]`.
///
/// A cut chain starts with its `[truncated: ...]` frame. `None` for a stack without chains
/// (whose views stay as they were: VM; process; module; function).
pub fn whole_stack<'a>(p: &'a Profile, s: &Stack) -> Option<Vec<Part<'a>>> {
    if s.calls == 0 {
        return None;
    }
    let c = p.calls.of(s);
    let f = &p.frames[s.frame as usize];
    let mut out = Vec::with_capacity(4 + c.host.len() + c.guest.len());
    let chain = |out: &mut Vec<Part<'a>>, sites: &[u32], end: ChainEnd| {
        if truncated_name(end).is_some() {
            out.push(Part::Truncated(end));
        }
        out.extend(sites.iter().rev().map(|&i| Part::Site(i)));
    };
    match s.what {
        What::GuestKernel | What::GuestUser => {
            out.push(Part::Root(Cow::Borrowed(&f.vm)));
            if !f.process.is_empty() {
                out.push(Part::Process(&f.process));
            }
            chain(&mut out, &c.guest, c.guest_end);
        }
        What::Hypervisor if s.exit_cause => {
            // `[hypervisor]`'s process frame is `VM: EXIT`; the root is the VM.
            out.push(Part::Root(match p.vms.iter().find(|v| v.id == s.vm) {
                Some(v) => Cow::Borrowed(&v.name),
                None => Cow::Owned(p.vm_name(s.vm)),
            }));
            chain(&mut out, &c.guest, c.guest_end);
            out.push(Part::Exit(s.exit));
            chain(&mut out, &c.host, c.host_end);
        }
        What::Hypervisor => {
            out.push(Part::Root(Cow::Borrowed(&f.vm)));
            out.push(Part::Process(&f.process));
            chain(&mut out, &c.host, c.host_end);
        }
        What::Idle => {
            out.push(Part::Root(Cow::Borrowed(&f.function)));
            chain(&mut out, &c.host, c.host_end);
        }
    }
    out.push(Part::Leaf(f));
    Some(out)
}

/// A part's name as the flame graph and the call graph give it.
pub fn part_name<'a>(p: &'a Profile, part: &Part<'a>) -> Cow<'a, str> {
    match part {
        Part::Root(n) => n.clone(),
        Part::Process(n) => Cow::Borrowed(n),
        Part::Truncated(end) => Cow::Borrowed(truncated_name(*end).unwrap_or("[truncated]")),
        Part::Site(i) => Cow::Borrowed(&p.calls.frame(*i).function),
        Part::Exit(r) => Cow::Owned(exit_frame_name(*r)),
        Part::Leaf(f) => Cow::Borrowed(&f.function),
    }
}

/// What distinguishes stacks' whole stacks (their layout, [`whole_stack`]): frame, named
/// chains, exit cause, VM.
pub type WholeKey = (u32, u32, bool, u16);

/// A stack's [`WholeKey`].
pub fn whole_key(s: &Stack) -> WholeKey {
    (s.frame, s.calls, s.exit_cause, s.vm)
}
