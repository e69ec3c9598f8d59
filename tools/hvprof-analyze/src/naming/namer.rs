//! What a sample is called: the VM table of the capture, which image names which VM's functions,
//! the Linux guests' kernels and processes, and the labels every output shares (the report's
//! tables, the charts, the flame graph, `perf script`, pprof, Firefox).
//!
//! A guest process is named by its task (`comm[tgid]`) where the log has task frames (Linux
//! guests), else by its address space: `cr3:0x...`. [`ProcessKey`] is what identifies it, so a
//! later source of names (another frame type, a symbol file) only changes [`Namer::process`].

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use hvprof_samplelog::{Decoded, Task};

use crate::naming::escape::printable;
use crate::naming::linux::{GuestKernel, KERNEL_MODULE, TaskTimeline};
use crate::naming::symbols::{Images, Symbols, hex};

/// One VM of the capture's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmMeta {
    pub id: u16,
    pub name: String,
    pub image: String,
    pub build_id: Vec<u8>,
    pub vcpus: u16,
}

/// The VMs the header lists.
pub fn vm_table(decoded: &Decoded) -> Vec<VmMeta> {
    decoded
        .header
        .as_ref()
        .map(|h| {
            h.vms
                .iter()
                .map(|v| VmMeta {
                    id: v.id,
                    name: printable(v.name.as_str()).into_owned(),
                    image: printable(v.image.as_str()).into_owned(),
                    build_id: v.image_build_id.as_bytes().to_vec(),
                    vcpus: v.vcpus,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Names an address in `symbols`, or `[unknown]` with the address.
pub fn function_name(symbols: Option<&Symbols>, addr: u64) -> String {
    symbols
        .and_then(|s| s.lookup(addr))
        .map_or_else(|| unknown(addr), str::to_owned)
}

/// `[unknown] 0x…`, as `format!("[unknown] {addr:#x}")` writes it, without the formatting
/// machinery: a capture without symbols has a name like it per distinct address.
fn unknown(addr: u64) -> String {
    let (buf, len) = unknown_bytes(addr);
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// The bytes of [`function_name`]'s `[unknown] 0x…` for `addr` (its first `len`), in a buffer
/// of its own: a table of a capture without symbols compares hundreds of thousands of them.
pub fn unknown_bytes(addr: u64) -> ([u8; 28], usize) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    const PREFIX: &[u8; 12] = b"[unknown] 0x";
    let digits = (64 - addr.leading_zeros()).div_ceil(4).max(1) as usize;
    let mut buf = [0u8; 28];
    buf[..12].copy_from_slice(PREFIX);
    for i in 0..digits {
        buf[12 + digits - 1 - i] = DIGITS[(addr >> (4 * i) & 0xf) as usize];
    }
    (buf, 12 + digits)
}

/// The name of a basic VM exit reason (Intel SDM Vol. 3D Table C-1), as `perf kvm stat` and the
/// hypervisor's own exit statistics print it.
pub fn exit_name(reason: u16) -> String {
    match hvprof_vmx::exit::BasicExit::from_number(reason) {
        Some(b) => b.name().to_owned(),
        None if reason == hvprof_samplelog::NO_EXIT => "NONE".to_owned(),
        None => format!("EXIT_{reason}"),
    }
}

/// Who a guest process is, before it is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProcessKey {
    /// A task of a Linux guest (index into the task table).
    Task(u32),
    /// An address space: the guest's CR3.
    Cr3(u64),
}

/// Who ran in each guest sample: what [`Namer::process_key`] needs, owned (the classifier
/// reads it on every core; `top` adds the task frames as the stream brings them).
#[derive(Clone, Default)]
pub struct Processes {
    linux: HashSet<u16>,
    tasks: TaskTimeline,
}

/// What [`Processes::key_memo`] found last: a vCPU's task (`None`: its address space) from TSC
/// `from` until `to` (none: from then on).
#[derive(Clone, Copy, Debug, Default)]
pub struct TaskMemo {
    valid: bool,
    vm: u16,
    vcpu: u16,
    from: u64,
    to: Option<u64>,
    task: Option<u32>,
}

impl Processes {
    /// The process of a guest sample: for Linux VMs the task its vCPU ran at `tsc` where the
    /// log names it, else its address space.
    #[inline]
    pub fn key(&self, vm: u16, vcpu: u16, tsc: u64, cr3: u64) -> ProcessKey {
        self.key_memo(&mut TaskMemo::default(), vm, vcpu, tsc, cr3)
    }

    /// [`Processes::key`], remembering in `memo` the answer and the stretch of the vCPU's time
    /// it holds for: a vCPU's consecutive samples mostly fall in one task's stretch, which then
    /// costs no lookup.
    #[inline]
    pub fn key_memo(
        &self,
        memo: &mut TaskMemo,
        vm: u16,
        vcpu: u16,
        tsc: u64,
        cr3: u64,
    ) -> ProcessKey {
        let hit = memo.valid
            && memo.vm == vm
            && memo.vcpu == vcpu
            && tsc >= memo.from
            && memo.to.is_none_or(|to| tsc < to);
        if !hit {
            let (task, from, to) = if self.linux.contains(&vm) {
                self.tasks.task_span_at(vm, vcpu, tsc)
            } else {
                (None, 0, None)
            };
            *memo = TaskMemo {
                valid: true,
                vm,
                vcpu,
                from,
                to,
                task: task.map(|i| i as u32),
            };
        }
        match memo.task {
            Some(i) => ProcessKey::Task(i),
            None => ProcessKey::Cr3(cr3),
        }
    }

    /// Whether any VM is a Linux guest (its samples' processes depend on the time).
    pub fn any_linux(&self) -> bool {
        !self.linux.is_empty()
    }

    /// Adds a task frame that arrives after the others (a live stream's): its VM is a Linux
    /// guest. A [`TaskMemo`] filled before may no longer hold.
    pub fn add_task(&mut self, task: &Task) {
        self.linux.insert(task.vm);
        self.tasks.push(task);
    }

    /// Forgets the task changes that no sample at or after `tsc` falls in. A [`TaskMemo`]
    /// filled before may no longer hold.
    pub fn forget_before(&mut self, tsc: u64) {
        self.tasks.forget_before(tsc);
    }

    /// The task's label (`comm[tgid]`) when the process is a task.
    pub fn label(&self, key: ProcessKey) -> Option<&str> {
        match key {
            ProcessKey::Task(i) => Some(self.tasks.label(i as usize)),
            ProcessKey::Cr3(_) => None,
        }
    }
}

/// Names samples the same way everywhere.
pub struct Namer<'a> {
    images: &'a Images,
    pub vms: Vec<VmMeta>,
    guest_symbols: HashMap<u16, &'a Symbols>,
    kernels: HashMap<u16, GuestKernel>,
    /// Linux VMs: their end frame has an `IA32_LSTAR`, or the log has task frames for them.
    linux: HashSet<u16>,
    tasks: TaskTimeline,
    /// Linux processes' executable file mappings (mapping frames).
    mappings: ProcessMappings,
    /// Whether each VM's Linux guest isolates its page tables (KPTI), where its end frame says.
    isolation: Isolation,
    /// Files found under `--guest-root` for them.
    root_symbols: Vec<Symbols>,
    /// Linux kernel modules (module mapping frames) by VM.
    modules: HashMap<u16, Vec<LoadedModule>>,
    /// The functions of the modules' `.ko` files found under `--guest-root`.
    module_symbols: Vec<Symbols>,
}

/// A loaded Linux kernel module: its core's place and its name, as a module mapping frame
/// gives them, and its `.ko`'s functions (index into `Namer::module_symbols`) when found.
struct LoadedModule {
    start: u64,
    end: u64,
    name: String,
    symbols: Option<usize>,
}

/// Executable file mappings by process instance: (VM, tgid, address space). Not by the task's
/// label: a process before and after an exec has one tgid and two address spaces, a PID reused
/// by a later process (even of the same `comm`) another address space, a page-table root
/// reused by a later process another tgid, and a `comm` changed by `prctl` is the same
/// process; each has its own files. A sample is looked up with its task's tgid and its own CR3.
type ProcessMappings = HashMap<(u16, u32, u64), Vec<Mapped>>;

/// Each VM's page-table isolation (KPTI), as its end frame tells.
type Isolation = HashMap<u16, bool>;

/// The address space of CR3 `cr3` in VM `vm`, as a process's maps are keyed: the page-table
/// root without its PCID, and without bit 12 where the VM isolates its page tables (a user-mode
/// CR3 is the user PGD of a pair, bit 12 above the kernel's that the maps were read through) or
/// did not say (a capture from before the end frame told: see [`Namer::mapped_function`]).
/// Without isolation bit 12 stays: an exec's new root may lie 4 KiB from the old one.
fn address_space(isolation: &Isolation, vm: u16, cr3: u64) -> u64 {
    match isolation.get(&vm) {
        Some(false) => own_space(cr3),
        _ => cr3 & !0x1fff,
    }
}

/// CR3 without its PCID bits only: the page-table root itself.
const fn own_space(cr3: u64) -> u64 {
    cr3 & !0xfff
}

/// A process's executable file mapping, with the symbols found for its file.
struct Mapped {
    /// When the hypervisor read it.
    tsc: u64,
    /// The page-table root it was read under, without the PCID ([`own_space`]).
    space: u64,
    start: u64,
    end: u64,
    pgoff: u64,
    /// The file's name (the module column).
    file: String,
    symbols: Option<SymbolsRef>,
}

#[derive(Clone, Copy)]
enum SymbolsRef {
    /// `images.guests[i]`.
    Image(usize),
    /// `root_symbols[i]`.
    Root(usize),
}

impl<'a> Namer<'a> {
    /// Matches each VM with its image (by build id, else by file name), each Linux VM with the
    /// kernel at its KASLR slide; says in `warnings` what stays unnamed.
    pub fn new(decoded: &Decoded, images: &'a Images, warnings: &mut Vec<String>) -> Self {
        let vms = vm_table(decoded);
        let lstars = crate::naming::linux::lstars(&decoded.vm_ends);
        let mut linux: HashSet<u16> = decoded.tasks.iter().map(|t| t.vm).collect();
        linux.extend(
            vms.iter()
                .filter(|v| lstars.contains_key(&v.id))
                .map(|v| v.id),
        );
        let guest_symbols = vms
            .iter()
            .filter_map(|v| {
                let by_id = (!v.build_id.is_empty())
                    .then(|| {
                        images
                            .guests
                            .iter()
                            .find(|s| s.build_id.as_deref() == Some(v.build_id.as_slice()))
                    })
                    .flatten();
                let found = by_id.or_else(|| {
                    images.guests.iter().find(|s| {
                        s.module == v.image || s.module == v.image.trim_end_matches(".elf")
                    })
                });
                if found.is_none() && !linux.contains(&v.id) {
                    warnings.push(format!(
                        "no symbols for VM {} (image {}, build id {}): its functions are shown as addresses",
                        v.name,
                        v.image,
                        if v.build_id.is_empty() { "none".into() } else { hex(&v.build_id) }
                    ));
                }
                found.map(|s| (v.id, s))
            })
            .collect();
        let mut kernels = HashMap::default();
        if let Some(image) = &images.kernel {
            for v in &vms {
                let Some(&lstar) = lstars.get(&v.id) else {
                    continue;
                };
                match image.kaslr_slide(lstar) {
                    Ok(slide) => {
                        kernels.insert(
                            v.id,
                            GuestKernel {
                                image: image.clone(),
                                slide,
                            },
                        );
                    }
                    Err(e) => warnings.push(format!(
                        "VM {}: the kernel given does not match its IA32_LSTAR {lstar:#x} ({e}): kernel functions are shown as addresses",
                        v.name
                    )),
                }
            }
            if kernels.is_empty() {
                warnings.push(
                    "--kernel given, but no VM printed its IA32_LSTAR (not a Linux guest, or it did not stop)"
                        .into(),
                );
            }
        } else {
            for v in vms.iter().filter(|v| linux.contains(&v.id)) {
                warnings.push(format!(
                    "no kernel symbols for VM {} (a Linux guest, image {}): its kernel functions are shown as addresses; --kernel (its vmlinux, or the bzImage it booted) names them",
                    v.name, v.image
                ));
            }
        }
        let isolation: Isolation = decoded
            .vm_ends
            .iter()
            .filter_map(|e| e.page_table_isolation.map(|on| (e.vm, on)))
            .collect();
        let (mappings, root_symbols) = mappings(decoded, &isolation, images, warnings);
        let (modules, module_symbols) = kernel_modules(decoded, images, warnings);
        Namer {
            images,
            vms,
            guest_symbols,
            kernels,
            linux,
            tasks: TaskTimeline::new(&decoded.tasks),
            mappings,
            isolation,
            root_symbols,
            modules,
            module_symbols,
        }
    }

    /// The address space of CR3 `cr3` in VM `vm`, as the processes' maps are keyed
    /// ([`address_space`]).
    pub fn address_space(&self, vm: u16, cr3: u64) -> u64 {
        address_space(&self.isolation, vm, cr3)
    }

    fn mapped_symbols(&self, r: SymbolsRef) -> &Symbols {
        match r {
            SymbolsRef::Image(i) => &self.images.guests[i],
            SymbolsRef::Root(i) => &self.root_symbols[i],
        }
    }

    /// A Linux user address through its process's mappings: (function, file), when a mapping
    /// frame of that process (the task's tgid, the sample's address space) covers it. Of
    /// several, the last read: the hypervisor reads a process's maps again when a sample falls
    /// outside those it knows (after a `dlopen`, an `munmap` and `mmap`). Without symbols for
    /// the file: `[unknown] file+offset`.
    fn mapped_function(&self, vm: u16, label: &str, cr3: u64, rip: u64) -> Option<Symbol> {
        let list = self
            .mappings
            .get(&(vm, task_tgid(label)?, self.address_space(vm, cr3)))?;
        // `max_by_key` keeps the last of equals: at one TSC, the later frame.
        let covering = || list.iter().filter(|m| (m.start..m.end).contains(&rip));
        let m = if self.isolation.contains_key(&vm) {
            // The list is the sample's own address space's.
            covering().max_by_key(|m| m.tsc)?
        } else {
            // A capture that does not say: the maps read under the sample's own root first
            // (without KPTI an exec's new root may lie 4 KiB from the old one), then under its
            // KPTI pair's.
            let own = own_space(cr3);
            covering()
                .filter(|m| m.space == own)
                .max_by_key(|m| m.tsc)
                .or_else(|| covering().max_by_key(|m| m.tsc))?
        };
        let named = m.symbols.and_then(|r| {
            self.mapped_symbols(r)
                .lookup_mapped_offset(rip, m.start, m.pgoff)
                .map(|(name, off)| (name.to_owned(), off))
        });
        let (function, offset) = match named {
            Some((name, off)) => (name, Some(off)),
            None => (
                format!(
                    "[unknown] {}+{:#x}",
                    m.file,
                    rip - m.start + m.pgoff.saturating_mul(4096)
                ),
                None,
            ),
        };
        Some(Symbol {
            function,
            module: m.file.clone(),
            offset,
        })
    }

    /// The VM's name (`vm<N>` for a VM the header does not list).
    pub fn vm_name(&self, vm: u16) -> String {
        self.vms
            .iter()
            .find(|v| v.id == vm)
            .map_or_else(|| format!("vm{vm}"), |v| v.name.clone())
    }

    /// The VM's image file name (empty when unknown).
    pub fn vm_image(&self, vm: u16) -> &str {
        self.vms
            .iter()
            .find(|v| v.id == vm)
            .map_or("", |v| v.image.as_str())
    }

    /// Whether the VM is a Linux guest (named by kernel, process and user image).
    pub fn is_linux(&self, vm: u16) -> bool {
        self.linux.contains(&vm)
    }

    /// The symbols matched to a VM's image.
    pub fn guest_symbols(&self, vm: u16) -> Option<&'a Symbols> {
        self.guest_symbols.get(&vm).copied()
    }

    /// The task a Linux guest's vCPU ran at `tsc`, from the task frames.
    pub fn task(&self, vm: u16, vcpu: u16, tsc: u64) -> Option<&str> {
        self.tasks.task_at(vm, vcpu, tsc)
    }

    /// Who ran in the guest: its task where the log names it, else its address space.
    pub fn process_key(&self, vm: u16, vcpu: u16, tsc: u64, cr3: u64) -> ProcessKey {
        match self.tasks.task_index_at(vm, vcpu, tsc) {
            Some(i) => ProcessKey::Task(i as u32),
            None => ProcessKey::Cr3(cr3),
        }
    }

    /// What finds the process of a guest sample, owned.
    pub fn processes(&self) -> Processes {
        Processes {
            linux: self.linux.clone(),
            tasks: self.tasks.clone(),
        }
    }

    /// The task's label (`comm[tgid]`) when the process is a task.
    pub fn task_label(&self, key: ProcessKey) -> Option<&str> {
        match key {
            ProcessKey::Task(i) => Some(self.tasks.label(i as usize)),
            ProcessKey::Cr3(_) => None,
        }
    }

    /// The process's label: `comm[tgid]` for a task, `cr3:0x...` for an address space.
    pub fn process(&self, key: ProcessKey) -> String {
        match key {
            ProcessKey::Task(i) => self.tasks.label(i as usize).to_owned(),
            ProcessKey::Cr3(cr3) => format!("cr3:{cr3:#x}"),
        }
    }

    /// A guest sample's function and module. Linux guests: kernel mode under
    /// `[guest.kallsyms]` (named with `--kernel`) or the loaded module's; user mode through the
    /// mapping frames of the process (the tgid in `process`, the task's label, and the address
    /// space of the sample's `cr3`), else from the image named like the process (`--image w41`
    /// for `w41[57]`). Other guests: their image's symbols.
    pub fn guest_function(
        &self,
        vm: u16,
        user: bool,
        rip: u64,
        cr3: u64,
        process: Option<&str>,
    ) -> (String, String) {
        let s = self.guest_symbol(vm, user, rip, cr3, process);
        (s.function, s.module)
    }

    /// [`Namer::guest_function`] with the address's offset in its function, where the symbol
    /// source gives the function's start.
    pub fn guest_symbol(
        &self,
        vm: u16,
        user: bool,
        rip: u64,
        cr3: u64,
        process: Option<&str>,
    ) -> Symbol {
        if !self.is_linux(vm) {
            return Symbol::from_lookup(self.guest_symbols(vm), rip, self.vm_image(vm));
        }
        if user {
            if let Some(named) = process.and_then(|p| self.mapped_function(vm, p, cr3, rip)) {
                return named;
            }
            let comm = process.map(|p| p.split_once('[').map_or(p, |(c, _)| c));
            match comm.and_then(|c| self.images.guests.iter().find(|s| s.module == c)) {
                Some(s) => Symbol::from_lookup(Some(s), rip, &s.module),
                None => Symbol {
                    function: format!("[unknown] {rip:#x}"),
                    module: "[unknown]".into(),
                    offset: None,
                },
            }
        } else if let Some(m) = self
            .modules
            .get(&vm)
            .and_then(|ms| ms.iter().rev().find(|m| (m.start..m.end).contains(&rip)))
        {
            // A loaded module (its symbols are in its .ko, not in kallsyms): the function its
            // .ko places there, else its name and the offset in its core, never the nearest
            // kernel symbol.
            let offset = rip - m.start;
            let found = m
                .symbols
                .and_then(|i| self.module_symbols.get(i))
                .and_then(|s| s.lookup_offset(offset));
            let (function, offset) = match found {
                Some((name, off)) => (name.to_owned(), Some(off)),
                None => (format!("[unknown] {}+{offset:#x}", m.name), None),
            };
            Symbol {
                function,
                module: format!("[{}]", m.name),
                offset,
            }
        } else {
            let (function, offset) =
                crate::naming::linux::kernel_symbol(self.kernels.get(&vm), rip);
            Symbol {
                function,
                module: KERNEL_MODULE.into(),
                offset,
            }
        }
    }

    /// A hypervisor address's function.
    pub fn hypervisor_function(&self, rip: u64) -> String {
        function_name(self.images.hypervisor.as_ref(), rip)
    }

    /// A hypervisor address's function, with the address's offset in it when named.
    pub fn hypervisor_symbol(&self, rip: u64) -> Symbol {
        Symbol::from_lookup(self.images.hypervisor.as_ref(), rip, "hvprof")
    }
}

/// An address named: its function, the module it is in, and its offset from the function's
/// start when the symbol source gives the start (`None` for an address without a function).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    /// The function (`[unknown] ...` when no symbol holds the address).
    pub function: String,
    /// The module column: the image, `[guest.kallsyms]`, a kernel module, a mapped file.
    pub module: String,
    /// The address's offset from the function's start.
    pub offset: Option<u64>,
}

impl Symbol {
    /// `addr` in `symbols`, or `[unknown]` with the address (as [`function_name`]).
    fn from_lookup(symbols: Option<&Symbols>, addr: u64, module: &str) -> Symbol {
        let (function, offset) = match symbols.and_then(|s| s.lookup_offset(addr)) {
            Some((name, off)) => (name.to_owned(), Some(off)),
            None => (function_name(None, addr), None),
        };
        Symbol {
            function,
            module: module.to_owned(),
            offset,
        }
    }
}

/// The tgid in a task label (`comm[tgid]` or `comm[tgid/pid]`, `TaskTimeline::label`).
fn task_tgid(label: &str) -> Option<u32> {
    let inside = label.rsplit_once('[')?.1.strip_suffix(']')?;
    inside.split('/').next()?.parse().ok()
}

/// The capture's process mappings by (VM, tgid, address space), each with the symbols of its
/// file: a `--image` with the same build id, else the file at the same path under
/// `--guest-root` (when its build id matches, or the frame has none), else a `--image` of the
/// same file name.
fn mappings(
    decoded: &Decoded,
    isolation: &Isolation,
    images: &Images,
    warnings: &mut Vec<String>,
) -> (ProcessMappings, Vec<Symbols>) {
    let mut out = ProcessMappings::default();
    let mut root: Vec<Symbols> = Vec::new();
    let mut root_paths: HashMap<String, Option<usize>> = HashMap::default();
    let mut mismatched: HashSet<String> = HashSet::default();
    for m in decoded
        .mappings
        .iter()
        .filter(|m| m.kind == hvprof_samplelog::MappingKind::Process)
    {
        let path = m.path.as_str();
        let file = printable(path.rsplit('/').next().unwrap_or(path)).into_owned();
        let id = (!m.build_id.is_none()).then(|| m.build_id.as_bytes());
        let by_id = id.and_then(|id| {
            images
                .guests
                .iter()
                .position(|s| s.build_id.as_deref() == Some(id))
                .map(SymbolsRef::Image)
        });
        let under_root = || -> Option<SymbolsRef> {
            let dir = images.guest_root.as_ref()?;
            let i = *root_paths.entry(path.to_owned()).or_insert_with(|| {
                let file = dir.join(path.trim_start_matches('/'));
                let s = Symbols::load(&file).ok()?.with_debug_file(dir);
                root.push(s);
                Some(root.len() - 1)
            });
            let i = i?;
            match (id, root[i].build_id.as_deref()) {
                (Some(want), Some(got)) if want != got => {
                    mismatched.insert(path.to_owned());
                    None
                }
                _ => Some(SymbolsRef::Root(i)),
            }
        };
        let symbols = by_id.or_else(under_root).or_else(|| {
            images
                .guests
                .iter()
                .position(|s| s.module == file)
                .map(SymbolsRef::Image)
        });
        let mapped = Mapped {
            tsc: m.tsc,
            space: own_space(m.cr3),
            start: m.start,
            end: m.end,
            pgoff: m.pgoff,
            file,
            symbols,
        };
        out.entry((m.vm, m.tgid, address_space(isolation, m.vm, m.cr3)))
            .or_default()
            .push(mapped);
    }
    for p in mismatched {
        warnings.push(format!(
            "{}: the file under --guest-root is not the one the guest ran (its build id differs): its functions are shown as offsets",
            printable(&p)
        ));
    }
    (out, root)
}

/// The capture's loaded kernel modules by VM, each with the functions of its `.ko` under
/// `--guest-root` (`lib/modules/<release>/**/<name>.ko`, the `--kernel` image's release first)
/// when found and plausibly the one loaded: a `.ko` whose text is larger than the core the
/// guest reported, or whose build id differs from the frame's, is another build and is not
/// used. Without `--guest-root` no file is looked for.
fn kernel_modules(
    decoded: &Decoded,
    images: &Images,
    warnings: &mut Vec<String>,
) -> (HashMap<u16, Vec<LoadedModule>>, Vec<Symbols>) {
    let frames: Vec<&hvprof_samplelog::Mapping> = decoded
        .mappings
        .iter()
        .filter(|m| m.kind == hvprof_samplelog::MappingKind::Module)
        .collect();
    let mut symbols: Vec<Symbols> = Vec::new();
    // Module key → (index into `symbols`, its text size), or `None` when not usable.
    let mut by_key: HashMap<String, Option<(usize, u64)>> = HashMap::default();
    if let Some(root) = images.guest_root.as_deref()
        && !frames.is_empty()
    {
        let mut names: Vec<String> = frames
            .iter()
            .map(|m| crate::naming::modules::module_key(m.path.as_str()))
            .collect();
        names.sort();
        names.dedup();
        let release = images.kernel.as_ref().and_then(|k| k.release());
        let files = crate::naming::modules::find_module_files(root, release, &names);
        let mut missing = Vec::new();
        for name in names {
            let loaded = match files.get(&name) {
                None => {
                    missing.push(printable(&name).into_owned());
                    None
                }
                Some(path) => match std::fs::read(path)
                    .map_err(anyhow::Error::from)
                    .and_then(|data| crate::naming::modules::parse_module(&data, path))
                {
                    Ok(m) => {
                        symbols.push(m.symbols);
                        Some((symbols.len() - 1, m.text_size))
                    }
                    Err(e) => {
                        warnings.push(format!(
                            "kernel module {}: {}: its functions are shown as offsets",
                            printable(&name),
                            printable(&format!("{e:#}"))
                        ));
                        None
                    }
                },
            };
            by_key.insert(name, loaded);
        }
        if !missing.is_empty() {
            warnings.push(format!(
                "kernel modules not found under {}/lib/modules/{}: {} (their functions are shown as offsets)",
                printable(&root.display().to_string()),
                printable(release.unwrap_or("*")),
                missing.join(", ")
            ));
        }
    }
    let mut mismatched: Vec<String> = Vec::new();
    let mut out: HashMap<u16, Vec<LoadedModule>> = HashMap::default();
    for m in frames {
        let name = printable(m.path.as_str()).into_owned();
        let found = by_key
            .get(&crate::naming::modules::module_key(m.path.as_str()))
            .copied()
            .flatten();
        let usable = found.filter(|&(i, text_size)| {
            let id = (!m.build_id.is_none()).then(|| m.build_id.as_bytes());
            let same_build = match (id, symbols[i].build_id.as_deref()) {
                (Some(want), Some(got)) => want == got,
                _ => true,
            };
            let fits = text_size <= m.end.saturating_sub(m.start);
            let usable = same_build && fits;
            if !usable && !mismatched.contains(&name) {
                mismatched.push(name.clone());
            }
            usable
        });
        let list = out.entry(m.vm).or_default();
        if !list
            .iter()
            .any(|l| l.start == m.start && l.end == m.end && l.name == name)
        {
            list.push(LoadedModule {
                start: m.start,
                end: m.end,
                name,
                symbols: usable.map(|(i, _)| i),
            });
        }
    }
    if !mismatched.is_empty() {
        warnings.push(format!(
            "kernel modules whose .ko under --guest-root is not the one loaded (another build id, or more code than the guest's module): {} (their functions are shown as offsets)",
            mismatched.join(", ")
        ));
    }
    (out, symbols)
}

#[cfg(test)]
mod module_tests {
    use super::*;
    use hvprof_samplelog::{FixedStr, Mapping, MappingKind};

    const BASE: u64 = 0xffff_ffff_c000_0000;

    fn module(start: u64, name: &str) -> Mapping {
        Mapping {
            kind: MappingKind::Module,
            start,
            end: start + 0x8000,
            path: FixedStr::truncated(name),
            ..Mapping::default()
        }
    }

    #[test]
    fn kernel_modules_are_named_from_their_ko_files_under_the_guest_root() {
        let root = crate::naming::symbols::tests::scratch("koroot");
        let dir = root.join("lib/modules/6.1.0-48-cloud-amd64/kernel");
        std::fs::create_dir_all(dir.join("crypto")).unwrap();
        std::fs::create_dir_all(dir.join("arch")).unwrap();
        let ko = crate::naming::modules::tests::synthetic_ko();
        std::fs::write(dir.join("crypto/wp512.ko"), &ko).unwrap();
        // The file's name has a dash, the kernel's module name an underscore.
        std::fs::write(dir.join("arch/crc32c-intel.ko"), &ko).unwrap();
        std::fs::write(dir.join("crypto/broken.ko"), b"\x7fELF garbage").unwrap();
        let decoded = Decoded {
            mappings: vec![
                module(BASE, "wp512"),
                module(BASE + 0x10_0000, "crc32c_intel"),
                module(BASE + 0x20_0000, "not_there"),
                module(BASE + 0x30_0000, "broken"),
                // A core smaller than the .ko's text: another build.
                Mapping {
                    end: BASE + 0x40_0100,
                    ..module(BASE + 0x40_0000, "wp512")
                },
            ],
            // A task frame makes VM 0 a Linux guest.
            tasks: vec![hvprof_samplelog::Task::default()],
            ..Decoded::default()
        };
        let kernel = |images: &Images, rip: u64| {
            let mut warnings = Vec::new();
            let n = Namer::new(&decoded, images, &mut warnings);
            assert!(n.is_linux(0));
            (n.guest_function(0, false, rip, 0, None), warnings)
        };
        let images = Images {
            guest_root: Some(root.clone()),
            ..Images::default()
        };
        let name = |rip: u64| kernel(&images, rip).0;
        let named = |f: &str, m: &str| (f.to_owned(), m.to_owned());
        assert_eq!(name(BASE + 0x20), named("mod_work", "[wp512]"));
        assert_eq!(name(BASE + 0x130), named("mod_exit", "[wp512]"));
        // In the module but in no function: its name and offset, not the nearest function.
        assert_eq!(name(BASE + 0x60), named("[unknown] wp512+0x60", "[wp512]"));
        assert_eq!(
            name(BASE + 0x2000),
            named("[unknown] wp512+0x2000", "[wp512]")
        );
        assert_eq!(name(BASE + 0x10_0020), named("mod_work", "[crc32c_intel]"));
        assert_eq!(
            name(BASE + 0x20_0020),
            named("[unknown] not_there+0x20", "[not_there]")
        );
        assert_eq!(
            name(BASE + 0x30_0020),
            named("[unknown] broken+0x20", "[broken]")
        );
        assert_eq!(
            name(BASE + 0x40_0020),
            named("[unknown] wp512+0x20", "[wp512]")
        );
        let (_, warnings) = kernel(&images, BASE);
        let missing: Vec<_> = warnings
            .iter()
            .filter(|w| w.contains("not_there"))
            .collect();
        assert_eq!(missing.len(), 1, "{warnings:?}");
        assert!(!missing[0].contains('\n'));
        assert!(
            warnings.iter().any(|w| w.contains("broken")),
            "{warnings:?}"
        );
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("not the one loaded") && w.contains("wp512")),
            "{warnings:?}"
        );
        // Without --guest-root: as before, and no warning about modules.
        let (plain, warnings) = kernel(&Images::default(), BASE + 0x20);
        assert_eq!(plain, named("[unknown] wp512+0x20", "[wp512]"));
        assert!(
            warnings.iter().all(|w| !w.contains("module")),
            "{warnings:?}"
        );
        let _ = std::fs::remove_dir_all(root);
    }
}

#[cfg(test)]
mod mapping_tests {
    use super::*;
    use hvprof_samplelog::{BuildId, FixedStr, Mapping, MappingKind, Task};

    fn mapping(tgid: u32, start: u64, end: u64, pgoff: u64, path: &str) -> Mapping {
        Mapping {
            kind: MappingKind::Process,
            cr3: match tgid {
                57 => 0x5000,
                59 if path == "/bin/sh" => 0x7000,
                59 => 0x9001,
                _ => 0,
            },
            tgid,
            start,
            end,
            pgoff,
            path: FixedStr::truncated(path),
            build_id: BuildId::NONE,
            ..Mapping::default()
        }
    }

    /// A mapping frame of `path` at 0x40_0000..0x40_4000 for process `tgid` in `cr3`, read at
    /// `tsc`.
    fn frame(tsc: u64, tgid: u32, cr3: u64, path: &str) -> Mapping {
        Mapping {
            tsc,
            cr3,
            ..mapping(tgid, 0x40_0000, 0x40_4000, 0, path)
        }
    }

    /// A capture whose VM end frame tells the guest's page-table isolation: with KPTI the maps
    /// were read through the kernel's PGD (bit 12 clear) and a user sample's root is its pair's
    /// user PGD; without it each root is its own space, with no fallback to the one 4 KiB away.
    #[test]
    fn the_vm_end_frames_isolation_keys_the_maps() {
        let decoded = |isolation: bool| Decoded {
            mappings: vec![
                frame(10, 70, 0x1_2000, "/bin/tar"),
                frame(20, 75, 0x5_0000, "/bin/ls"),
                frame(30, 75, 0x5_1000, "/bin/cat"),
                Mapping {
                    tsc: 40,
                    cr3: 0x5_1000,
                    ..mapping(75, 0x60_0000, 0x60_1000, 0, "/bin/cat")
                },
            ],
            vm_ends: vec![hvprof_samplelog::VmEnd {
                vm: 0,
                page_table_isolation: Some(isolation),
                ..Default::default()
            }],
            tasks: vec![Task::default()],
            ..Decoded::default()
        };
        let images = Images::default();
        let mut warnings = Vec::new();
        let kpti = decoded(true);
        let n = Namer::new(&kpti, &images, &mut warnings);
        let file = |n: &Namer, label: &str, rip: u64, cr3: u64| {
            n.guest_function(0, true, rip, cr3, Some(label)).1
        };
        // The user PGD of tar's pair, with a PCID: the kernel PGD's maps.
        assert_eq!(file(&n, "tar[70]", 0x40_0123, 0x1_3000 | 5), "tar");
        let plain = decoded(false);
        let n = Namer::new(&plain, &images, &mut warnings);
        assert_eq!(file(&n, "tar[70]", 0x40_0123, 0x1_3000 | 5), "[unknown]");
        assert_eq!(file(&n, "ls[75]", 0x40_0123, 0x5_0000 | 3), "ls");
        assert_eq!(file(&n, "cat[75]", 0x40_0123, 0x5_1000), "cat");
        // Only cat's root maps 0x600000: ls's sample there is not named by it.
        assert_eq!(file(&n, "ls[75]", 0x60_0010, 0x5_0000), "[unknown]");
        assert_eq!(file(&n, "cat[75]", 0x60_0010, 0x5_1000), "cat");
    }

    #[test]
    fn mappings_belong_to_a_process_instance() {
        let decoded = Decoded {
            mappings: vec![
                // An exec: tgid 70 runs /bin/sh in 0x10000, then /bin/tar in a new space.
                frame(10, 70, 0x1_0000, "/bin/sh"),
                frame(20, 70, 0x1_2000 | 0x1000 | 5, "/bin/tar"),
                frame(22, 75, 0x5_0000, "/bin/ls"),
                frame(24, 75, 0x5_1000, "/bin/cat"),
                // A reused PID: tgid 80 runs a `job` twice, each run its own space and file
                // (two builds with other functions at one address).
                Mapping {
                    tsc: 30,
                    cr3: 0x2_0000,
                    ..mapping(80, 0x20_0000, 0x20_4000, 0, "/opt/v1/job")
                },
                Mapping {
                    tsc: 40,
                    cr3: 0x2_4000,
                    ..mapping(80, 0x20_0000, 0x20_4000, 0, "/opt/v2/job")
                },
                // An mm reused: space 0x30000 was tgid 90's, then tgid 91's.
                frame(50, 90, 0x3_0000, "/bin/first"),
                frame(60, 91, 0x3_0000, "/bin/second"),
                // Maps read again (a dlopen over an unmapped range): the last read wins, even
                // listed first (frames of several pCPUs are not in TSC order).
                frame(90, 95, 0x4_0000, "/lib/newer.so"),
                frame(70, 95, 0x4_0000, "/lib/older.so"),
            ],
            tasks: vec![Task::default()],
            ..Decoded::default()
        };
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let root = crate::naming::symbols::tests::scratch("instances");
        for (dir, elf) in [("opt/v1", "mix.elf"), ("opt/v2", "busy.elf")] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
            std::fs::copy(data.join(elf), root.join(dir).join("job")).unwrap();
        }
        let images = Images {
            guest_root: Some(root.clone()),
            ..Images::default()
        };
        let mut warnings = Vec::new();
        let n = Namer::new(&decoded, &images, &mut warnings);
        let file = |label: &str, cr3: u64| n.guest_function(0, true, 0x40_0123, cr3, Some(label)).1;
        assert_eq!(file("sh[70]", 0x1_0000), "sh");
        assert_eq!(file("tar[70]", 0x1_2000), "tar");
        // The KPTI user half and a PCID: the same space.
        assert_eq!(file("tar[70]", 0x1_3000 | 7), "tar");
        // Without KPTI, an exec into a root 4 KiB from the old one: each sample its own root's
        // file, though both read later than the other's.
        assert_eq!(file("ls[75]", 0x5_0000 | 3), "ls");
        assert_eq!(file("cat[75]", 0x5_1000 | 2), "cat");
        // Same label, same address: the functions of the sample's own space's file.
        let job = |cr3: u64| n.guest_function(0, true, 0x20_0484, cr3, Some("job[80]"));
        assert_eq!(job(0x2_0000), ("work_a".to_owned(), "job".to_owned()));
        let (second, module) = job(0x2_4000);
        assert_eq!(module, "job");
        assert_ne!(
            second, "work_a",
            "the first run's file named the second's sample"
        );
        assert!(!second.starts_with("[unknown]"), "{second}");
        // The same space, another tgid: each process its own file.
        assert_eq!(file("first[90]", 0x3_0000), "first");
        assert_eq!(file("second[91]", 0x3_0000), "second");
        // A comm changed by prctl (or a thread): the same process, the same files.
        assert_eq!(file("renamed[90]", 0x3_0000), "first");
        assert_eq!(file("first[90/93]", 0x3_0000), "first");
        // A space the process never had maps: not another instance's file.
        assert_eq!(file("first[90]", 0x5_0000), "[unknown]");
        assert_eq!(file("newer[95]", 0x4_0000), "newer.so");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn unknown_addresses_are_named_as_format_writes_them() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut addrs = vec![0, 1, 0xf, 0x10, 0xffff_ffff_ffff_ffff, 1 << 63];
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            addrs.push(x >> (x % 64));
        }
        for a in addrs {
            assert_eq!(function_name(None, a), format!("[unknown] {a:#x}"));
        }
    }

    #[test]
    fn user_addresses_are_named_through_their_process_mappings() {
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        // A guest root holding /bin/mix (a fixed-address program: work_a at 0x200480).
        let root = std::env::temp_dir().join(format!("hvprof-root-{}", std::process::id()));
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::copy(data.join("mix.elf"), root.join("bin/mix")).unwrap();
        let images = Images {
            guest_root: Some(root.clone()),
            ..Images::default()
        };
        let decoded = Decoded {
            tasks: vec![
                Task {
                    tgid: 57,
                    pid: 57,
                    cr3: 0x5000,
                    comm: FixedStr::truncated("mix"),
                    ..Task::default()
                },
                // Process 59 runs `sh`, then execs `mix` (a new name, a new address space).
                Task {
                    tgid: 59,
                    pid: 59,
                    cr3: 0x7000,
                    comm: FixedStr::truncated("sh"),
                    ..Task::default()
                },
                Task {
                    tgid: 59,
                    pid: 59,
                    cr3: 0x9000 | 0x1003, // KPTI user half, PCID 3
                    comm: FixedStr::truncated("mix"),
                    ..Task::default()
                },
            ],
            mappings: vec![
                mapping(57, 0x20_0000, 0x20_4000, 0, "/bin/mix"),
                mapping(
                    57,
                    0x7f00_0000_0000,
                    0x7f00_0010_0000,
                    0x28,
                    "/lib/libc.so.6",
                ),
                mapping(58, 0x20_0000, 0x20_4000, 0, "/bin/other"),
                mapping(59, 0x20_0000, 0x20_4000, 0, "/bin/sh"),
                mapping(59, 0x20_0000, 0x20_4000, 0, "/bin/mix"),
                Mapping {
                    kind: MappingKind::Module,
                    start: 0xffff_ffff_c000_0000,
                    end: 0xffff_ffff_c000_8000,
                    path: FixedStr::truncated("wp512"),
                    ..Mapping::default()
                },
            ],
            ..Decoded::default()
        };
        let mut warnings = Vec::new();
        let n = Namer::new(&decoded, &images, &mut warnings);
        assert_eq!(
            n.guest_function(0, true, 0x20_0484, 0x5000, Some("mix[57]")),
            ("work_a".to_owned(), "mix".to_owned())
        );
        // A thread's label names its process's mappings too.
        assert_eq!(
            n.guest_function(0, true, 0x20_0490, 0x5000, Some("mix[57/60]"))
                .0,
            "work_b"
        );
        // A file with no symbols: its name and the file offset, never a nearby symbol.
        assert_eq!(
            n.guest_function(0, true, 0x7f00_0000_1234, 0x5000, Some("mix[57]")),
            (
                "[unknown] libc.so.6+0x29234".to_owned(),
                "libc.so.6".to_owned()
            )
        );
        // Another process's mapping of another file at the same address is its own.
        assert_eq!(
            n.guest_function(0, true, 0x20_0484, 0, Some("other[58]")).1,
            "other"
        );
        // Outside every mapping: as before (no image named like the process: unknown).
        assert_eq!(
            n.guest_function(0, true, 0x1234, 0x5000, Some("mix[57]")).1,
            "[unknown]"
        );
        // Before its exec process 59 is `sh` (no symbols: file and offset), after it `mix`.
        assert_eq!(
            n.guest_function(0, true, 0x20_0484, 0x7000, Some("sh[59]")),
            ("[unknown] sh+0x484".to_owned(), "sh".to_owned())
        );
        assert_eq!(
            n.guest_function(0, true, 0x20_0484, 0x9000 | 0x1003, Some("mix[59]")),
            ("work_a".to_owned(), "mix".to_owned())
        );
        // Kernel code in a loaded module: the module's name and offset.
        assert_eq!(
            n.guest_function(0, false, 0xffff_ffff_c000_0123, 0x5000, Some("mix[57]")),
            ("[unknown] wp512+0x123".to_owned(), "[wp512]".to_owned())
        );
        // The root has no lib/modules: said once.
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("kernel modules not found under"));
        assert!(warnings[0].contains("wp512"));
        assert_eq!(task_tgid("w41[57/60]"), Some(57));
        assert_eq!(task_tgid("a[b]c[7]"), Some(7));
        assert_eq!(task_tgid("nolabel"), None);
        let _ = std::fs::remove_dir_all(root);
    }
}

#[cfg(test)]
mod process_tests {
    use super::*;
    use hvprof_samplelog::{FixedStr, Task};
    use proptest::prelude::*;

    proptest! {
        /// The memo kept from sample to sample answers as a fresh one does, whatever the order
        /// of the samples (vCPUs interleaved, time going back), with task frames at equal times
        /// and VMs that are not Linux guests.
        #[test]
        fn key_memo_is_key(
            frames in prop::collection::vec((0u16..3, 0u16..2, 0u64..1000, 0u32..6), 0..40),
            samples in prop::collection::vec((0u16..3, 0u16..2, 0u64..1100, any::<u64>()), 1..300),
        ) {
            let tasks: Vec<Task> = frames
                .iter()
                .map(|&(vm, vcpu, tsc, pid)| Task {
                    vm,
                    vcpu,
                    tsc,
                    pid,
                    tgid: pid,
                    comm: FixedStr::truncated("t"),
                    ..Task::default()
                })
                .collect();
            let p = Processes {
                // VM 2 is no Linux guest, even with task frames.
                linux: [0u16, 1].into_iter().collect(),
                tasks: TaskTimeline::new(&tasks),
            };
            let mut memo = TaskMemo::default();
            for &(vm, vcpu, tsc, cr3) in &samples {
                prop_assert_eq!(
                    p.key_memo(&mut memo, vm, vcpu, tsc, cr3),
                    p.key(vm, vcpu, tsc, cr3)
                );
            }
        }
    }
}
