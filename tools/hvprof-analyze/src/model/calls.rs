//! The call chains of a profile, named: each distinct frame address in its naming context once
//! (a [`CallSite`]), each distinct function once (a [`CallFrame`]), each distinct pair of named
//! chains once (a [`CallStack`], which every stack with chains points to).
//!
//! A frame of a chain is a return address: it is named as the call instruction before it
//! (`addr - 1`, as perf does), in the symbols that name the sample's leaf: the hypervisor's ELF
//! for host frames; for guest frames the VM's image, or for a Linux guest its kernel (an address
//! in the kernel half) or its process's files (in the user half). A hypervisor sample taken on
//! a vCPU's exit has that vCPU's guest chain: the guest RIP at the exit (an instruction, named
//! as it is), then its callers.
//!
//! [`whole_stack`] lays a sample's stack out, outermost first, the one way the flame graph,
//! `perf script`, pprof and the Firefox profile draw it; [`crate::views::callgraph`] counts callers and
//! callees from it.

use std::borrow::Cow;

use rustc_hash::FxHashMap as HashMap;

use crate::model::interner::Interner;
use crate::model::profile::{ChainEnd, Frame, Profile, Samples, Stack, What};
use crate::naming::namer::{Namer, ProcessKey, address_space};

/// A function of a call chain, named.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallFrame {
    /// `Hypervisor` for the hypervisor's frames, `GuestKernel` or `GuestUser` for a guest's.
    pub what: What,
    /// Its name (`[unknown] 0x...` without symbols for it).
    pub function: String,
    /// The file it is in (`hvprof` for the hypervisor).
    pub module: String,
}

/// One frame address of a chain in its naming context: the address as the chain holds it,
/// its function (index into [`Calls::frames`]), and its offset from the function's start when
/// the symbols give the start (`perf script`'s `function+0x12`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSite {
    /// The address as the chain holds it (a return address, or an exit's RIP).
    pub addr: u64,
    /// Its function: index into [`Calls::frames`].
    pub frame: u32,
    /// `addr`'s offset from the function's start, when the symbols give the start.
    pub offset: Option<u64>,
}

/// A sample's chains, named: indexes into [`Calls::sites`], innermost first, and how each walk
/// ended. A hypervisor sample's guest chain is its exit cause (`Stack::exit_cause`); a guest
/// sample has no host chain.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallStack {
    /// The hypervisor's frames.
    pub host: Vec<u32>,
    /// How the hypervisor's walk ended (`NotWalked` without a host chain).
    pub host_end: ChainEnd,
    /// The guest's frames.
    pub guest: Vec<u32>,
    /// How the guest's walk ended (`NotWalked` without a guest chain).
    pub guest_end: ChainEnd,
}

impl Default for CallStack {
    fn default() -> Self {
        CallStack {
            host: Vec::new(),
            host_end: ChainEnd::NotWalked,
            guest: Vec::new(),
            guest_end: ChainEnd::NotWalked,
        }
    }
}

/// The named call chains of a profile.
#[derive(Debug, Clone)]
pub struct Calls {
    /// Distinct functions (by what, function, module).
    pub frames: Vec<CallFrame>,
    /// Distinct frame addresses in their naming context.
    pub sites: Vec<CallSite>,
    /// Distinct named chains; index 0 is the sample without chains.
    pub stacks: Vec<CallStack>,
}

impl Default for Calls {
    fn default() -> Self {
        Calls {
            frames: Vec::new(),
            sites: Vec::new(),
            stacks: vec![CallStack::default()],
        }
    }
}

impl Calls {
    /// A stack's named chains (the empty one without).
    pub fn of(&self, s: &Stack) -> &CallStack {
        self.stacks.get(s.calls as usize).unwrap_or(&self.stacks[0])
    }

    /// A site's function.
    pub fn frame(&self, site: u32) -> &CallFrame {
        &self.frames[self.sites[site as usize].frame as usize]
    }
}

/// What names a frame address: the hypervisor's symbols, or a VM's guest context (for a
/// Linux guest's user address also its process and address space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SiteKey {
    Host {
        addr: u64,
        exact: bool,
    },
    Guest {
        vm: u16,
        user: bool,
        addr: u64,
        exact: bool,
        process: Option<ProcessKey>,
        space: u64,
    },
}

impl SiteKey {
    fn addr(&self) -> u64 {
        match *self {
            SiteKey::Host { addr, .. } | SiteKey::Guest { addr, .. } => addr,
        }
    }
}

/// The site keys of a stack's chains, innermost first (host, guest); the guest frames of a
/// sample that has no guest context (idle, the hypervisor for no VM) and the host frames of a
/// guest sample are left out.
fn site_keys(namer: &Namer, s: &Stack, samples: &Samples) -> (Vec<SiteKey>, Vec<SiteKey>) {
    let Some(c) = samples.chain(s.chain) else {
        return (Vec::new(), Vec::new());
    };
    let guest_ctx = matches!(s.what, What::GuestKernel | What::GuestUser) || s.exit_cause;
    let host: Vec<SiteKey> = if guest_ctx && !s.exit_cause {
        Vec::new()
    } else {
        c.host
            .iter()
            .map(|&addr| SiteKey::Host { addr, exact: false })
            .collect()
    };
    let guest: Vec<SiteKey> = if guest_ctx {
        let linux = namer.is_linux(s.vm);
        c.guest
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                let user = if linux {
                    !crate::naming::linux::is_kernel_address(addr)
                } else {
                    s.what == What::GuestUser
                };
                let by_process = linux && user;
                SiteKey::Guest {
                    vm: s.vm,
                    user,
                    addr,
                    exact: s.exit_cause && i == 0,
                    process: if by_process { s.process } else { None },
                    space: if by_process { address_space(s.cr3) } else { 0 },
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    (host, guest)
}

/// Names one site.
fn name_site(namer: &Namer, k: &SiteKey) -> (CallFrame, Option<u64>) {
    // A return address is named as the call before it; its offset is the address's own.
    let looked = |addr: u64, exact: bool| if exact { addr } else { addr.wrapping_sub(1) };
    let (what, sym, shift) = match *k {
        SiteKey::Host { addr, exact } => (
            What::Hypervisor,
            namer.hypervisor_symbol(looked(addr, exact)),
            u64::from(!exact),
        ),
        SiteKey::Guest {
            vm,
            user,
            addr,
            exact,
            process,
            space,
        } => {
            let task = process.and_then(|p| namer.task_label(p));
            (
                if user {
                    What::GuestUser
                } else {
                    What::GuestKernel
                },
                namer.guest_symbol(vm, user, looked(addr, exact), space, task),
                u64::from(!exact),
            )
        }
    };
    (
        CallFrame {
            what,
            function: sym.function,
            module: sym.module,
        },
        sym.offset.map(|o| o.wrapping_add(shift)),
    )
}

/// Names the chains of the stacks `needed` accepts: returns them and each stack's index into
/// `Calls::stacks` (0 for the others and those without chains).
pub fn name(
    samples: &Samples,
    namer: &Namer,
    needed: impl Fn(&Stack) -> bool,
) -> (Calls, Vec<u32>) {
    let mut calls = Calls::default();
    let stacks = samples.stacks();
    if !samples.has_chains() {
        return (calls, vec![0; stacks.len()]);
    }
    // Every distinct site, named once, on every core. (Each stack's site keys are made again
    // below rather than kept: memory stays with the distinct sites.)
    let mut site_ids: HashMap<SiteKey, u32> = HashMap::default();
    let mut distinct: Vec<SiteKey> = Vec::new();
    for s in stacks.iter().filter(|s| s.chain != 0 && needed(s)) {
        let (host, guest) = site_keys(namer, s, samples);
        for k in host.iter().chain(&guest) {
            site_ids.entry(*k).or_insert_with(|| {
                distinct.push(*k);
                (distinct.len() - 1) as u32
            });
        }
    }
    let chunks: Vec<&[SiteKey]> = distinct.chunks(4096).collect();
    let named: Vec<(CallFrame, Option<u64>)> = crate::model::par::par_map(chunks, |c| {
        c.iter().map(|k| name_site(namer, k)).collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    let mut frame_ids: HashMap<CallFrame, u32> = HashMap::default();
    for (k, (frame, offset)) in distinct.iter().zip(named) {
        let next = calls.frames.len() as u32;
        let frame = *frame_ids.entry(frame.clone()).or_insert_with(|| {
            calls.frames.push(frame);
            next
        });
        calls.sites.push(CallSite {
            addr: k.addr(),
            frame,
            offset,
        });
    }
    // Each stack's named chains, each distinct one kept once (the first, no chain, is 0).
    let mut interned: Interner<CallStack> = Interner::with_capacity(1);
    interned.number(&CallStack::default(), CallStack::default);
    let out = stacks
        .iter()
        .map(|s| {
            if s.chain == 0 || !needed(s) {
                return 0;
            }
            let Some(c) = samples.chain(s.chain) else {
                return 0;
            };
            let (host, guest) = site_keys(namer, s, samples);
            let ids = |ks: &[SiteKey]| ks.iter().map(|k| site_ids[k]).collect::<Vec<u32>>();
            let guest_ctx = matches!(s.what, What::GuestKernel | What::GuestUser) || s.exit_cause;
            let cs = CallStack {
                host: ids(&host),
                host_end: if guest_ctx && !s.exit_cause {
                    ChainEnd::NotWalked
                } else {
                    c.host_end
                },
                guest: ids(&guest),
                guest_end: if guest_ctx {
                    c.guest_end
                } else {
                    ChainEnd::NotWalked
                },
            };
            // Kept (cloned) when first seen only.
            interned.number(&cs, || cs.clone()).0
        })
        .collect();
    calls.stacks = interned.values;
    (calls, out)
}

/// The name of the frame a truncated chain gets as its outermost: `[truncated: depth limit]`
/// or `[truncated: bad frame]` (`None` for a chain that was not cut).
pub fn truncated_name(end: ChainEnd) -> Option<&'static str> {
    match end {
        ChainEnd::DepthLimit => Some("[truncated: depth limit]"),
        ChainEnd::BadFrame => Some("[truncated: bad frame]"),
        ChainEnd::Complete | ChainEnd::NotWalked => None,
    }
}

/// The frame between an exit cause's guest frames and the hypervisor's: `[exit: CPUID]`.
pub fn exit_frame_name(exit: u16) -> String {
    format!("[exit: {}]", crate::naming::namer::exit_name(exit))
}

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
