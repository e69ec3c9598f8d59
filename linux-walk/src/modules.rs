//! The kernel's loaded modules: the list `modules` (a `struct list_head`, `kernel/module/main.c`)
//! threads every `struct module` through its `list` member; each has its `name` and, through
//! Linux 6.3, its core layout (`core_layout.base`, `.size`: where its text and data are).

use crate::{Budget, GuestMemory, Stop, field, kernel_ptr, read, read_u32, read_u64};

/// Where the module list and a module's fields are (the `modules` symbol from kallsyms, the
/// offsets from BTF).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ModuleLayout {
    /// The address of the `modules` list head (before the KASLR slide is applied: the caller
    /// adds it).
    pub modules: u64,
    /// `module.list`.
    pub list: u32,
    /// `module.name` and its length (`MODULE_NAME_LEN`, 56).
    pub name: u32,
    /// See `name`.
    pub name_len: u32,
    /// `module.core_layout` plus `module_layout.base` (pointer) and plus `.size` (u32).
    pub base: u32,
    /// See `base`.
    pub size: u32,
    /// The link-time address of `entry_SYSCALL_64`: with the guest's IA32_LSTAR (where that
    /// entry runs) it gives the KASLR slide to apply to `modules`.
    pub entry_syscall_64: u64,
}

impl ModuleLayout {
    /// The compact form (the hypervisor's `module-layout=` argument): `modules:entry:list:name:
    /// name_len:base:size`, the two addresses in 0x-hex, the offsets in decimal.
    #[must_use]
    pub fn parse(s: &str) -> Option<ModuleLayout> {
        let mut it = s.split(':');
        let hex = |v: Option<&str>| u64::from_str_radix(v?.strip_prefix("0x")?, 16).ok();
        let dec = |v: Option<&str>| v?.parse::<u32>().ok();
        let l = ModuleLayout {
            modules: hex(it.next())?,
            entry_syscall_64: hex(it.next())?,
            list: dec(it.next())?,
            name: dec(it.next())?,
            name_len: dec(it.next())?,
            base: dec(it.next())?,
            size: dec(it.next())?,
        };
        (it.next().is_none()
            && (1..=MODULE_NAME_LEN).contains(&(l.name_len as usize))
            && kernel_ptr(l.modules))
        .then_some(l)
    }

    /// The `modules` list head in a kernel whose IA32_LSTAR is `lstar` (KASLR slide applied).
    #[must_use]
    pub fn head(&self, lstar: u64) -> u64 {
        self.modules
            .wrapping_add(lstar.wrapping_sub(self.entry_syscall_64))
    }
}

impl core::fmt::Display for ModuleLayout {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{:#x}:{:#x}:{}:{}:{}:{}:{}",
            self.modules,
            self.entry_syscall_64,
            self.list,
            self.name,
            self.name_len,
            self.base,
            self.size
        )
    }
}

/// The longest module name kept (`MODULE_NAME_LEN` is 56 on 64-bit).
pub const MODULE_NAME_LEN: usize = 56;

/// One loaded module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Its `struct module`'s address.
    pub module: u64,
    /// Its name (NUL-padded).
    pub name: [u8; MODULE_NAME_LEN],
    /// Where its core (text and data) is mapped, and its size.
    pub base: u64,
    /// See `base`.
    pub size: u32,
}

impl Module {
    /// The name, up to its first NUL.
    #[must_use]
    pub fn name(&self) -> &[u8] {
        let n = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(MODULE_NAME_LEN);
        &self.name[..n]
    }
}

/// The outcome of [`walk_modules`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleWalk {
    /// Modules given to the sink.
    pub modules: u32,
    /// Why the walk ended early (`None`: back at the list head).
    pub stop: Option<Stop>,
}

/// The most modules [`walk_modules`] follows (a list that does not come back to its head is a
/// cycle or garbage).
pub const MAX_MODULES: u32 = 4096;

/// Walks the module list from its head at `head` (the `modules` symbol plus the KASLR slide),
/// giving each module to `sink` (which returns `false` to stop). Bounded by `budget` and
/// `MAX_MODULES`; a node whose `next->prev` is not itself stops the walk as malformed.
pub fn walk_modules(
    mem: &dyn GuestMemory,
    layout: &ModuleLayout,
    head: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&Module) -> bool,
) -> ModuleWalk {
    let mut walk = ModuleWalk::default();
    walk.stop = walk_inner(mem, layout, head, budget, sink, &mut walk).err();
    walk
}

fn walk_inner(
    mem: &dyn GuestMemory,
    layout: &ModuleLayout,
    head: u64,
    budget: &mut Budget,
    sink: &mut dyn FnMut(&Module) -> bool,
    walk: &mut ModuleWalk,
) -> Result<(), Stop> {
    if !kernel_ptr(head) || layout.name_len as usize > MODULE_NAME_LEN || layout.name_len == 0 {
        return Err(Stop::Malformed);
    }
    let mut prev = head;
    let mut node = read_u64(mem, budget, head)?;
    for _ in 0..MAX_MODULES {
        if node == head {
            return Ok(());
        }
        if !kernel_ptr(node) {
            return Err(Stop::Malformed);
        }
        // list_head { next, prev }: the back link must be where we came from.
        if read_u64(mem, budget, field(node, 8)?)? != prev {
            return Err(Stop::Malformed);
        }
        let module = node
            .checked_sub(u64::from(layout.list))
            .ok_or(Stop::Malformed)?;
        let mut m = Module {
            module,
            name: [0; MODULE_NAME_LEN],
            base: read_u64(mem, budget, field(module, layout.base)?)?,
            size: read_u32(mem, budget, field(module, layout.size)?)?,
        };
        read(
            mem,
            budget,
            field(module, layout.name)?,
            &mut m.name[..layout.name_len as usize],
        )?;
        walk.modules += 1;
        if !sink(&m) {
            return Err(Stop::Full);
        }
        prev = node;
        node = read_u64(mem, budget, node)?;
    }
    Err(Stop::Malformed)
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, reason = "test values are small")]
mod tests {
    use super::*;
    use crate::model::Memory;
    use proptest::prelude::*;

    /// Linux 6.1's layout (x86-64).
    const LAYOUT: ModuleLayout = ModuleLayout {
        modules: 0,
        entry_syscall_64: 0,
        list: 8,
        name: 24,
        name_len: 56,
        base: 0x150,
        size: 0x158,
    };
    const HEAD: u64 = 0xffff_ffff_8280_0000;

    fn module_list(mem: &mut Memory, names: &[&str]) -> Vec<u64> {
        let at = |i: usize| 0xffff_ffff_c000_0000 + 0x1000 * i as u64;
        let node = |i: usize| if i == usize::MAX { HEAD } else { at(i) + 8 };
        mem.zero(HEAD, 16);
        let n = names.len();
        for (i, name) in names.iter().enumerate() {
            mem.zero(at(i), 0x200);
            let next = if i + 1 == n { HEAD } else { node(i + 1) };
            let prev = if i == 0 { HEAD } else { node(i - 1) };
            mem.put_u64(node(i), next);
            mem.put_u64(node(i) + 8, prev);
            mem.put(at(i) + 24, name.as_bytes());
            mem.put_u64(at(i) + 0x150, 0xffff_ffff_c100_0000 + 0x10_0000 * i as u64);
            mem.put_u32(at(i) + 0x158, 0x4000);
        }
        mem.put_u64(HEAD, if n == 0 { HEAD } else { node(0) });
        mem.put_u64(HEAD + 8, if n == 0 { HEAD } else { node(n - 1) });
        (0..n).map(at).collect()
    }

    fn names(mem: &Memory, budget: u32) -> (Vec<String>, ModuleWalk) {
        let mut got = Vec::new();
        let w = walk_modules(mem, &LAYOUT, HEAD, &mut Budget::new(budget), &mut |m| {
            got.push(String::from_utf8_lossy(m.name()).into_owned());
            true
        });
        (got, w)
    }

    #[test]
    fn every_module_in_list_order() {
        let mut mem = Memory::default();
        let addrs = module_list(&mut mem, &["virtio_net", "ext4", "crc32c_generic"]);
        let (got, w) = names(&mem, 1000);
        assert_eq!(got, ["virtio_net", "ext4", "crc32c_generic"]);
        assert_eq!(
            w,
            ModuleWalk {
                modules: 3,
                stop: None
            }
        );
        let mut first = None;
        walk_modules(&mem, &LAYOUT, HEAD, &mut Budget::new(100), &mut |m| {
            first = Some(*m);
            false
        });
        let m = first.unwrap();
        assert_eq!(
            (m.module, m.base, m.size),
            (addrs[0], 0xffff_ffff_c100_0000, 0x4000)
        );
        let mut empty = Memory::default();
        module_list(&mut empty, &[]);
        assert_eq!(names(&empty, 10), (vec![], ModuleWalk::default()));
    }

    #[test]
    fn the_compact_form_round_trips_and_the_slide_applies() {
        let l = ModuleLayout {
            modules: 0xffff_ffff_8280_0000,
            entry_syscall_64: 0xffff_ffff_81c0_0080,
            ..LAYOUT
        };
        let s = l.to_string();
        assert_eq!(ModuleLayout::parse(&s), Some(l));
        assert_eq!(ModuleLayout::parse("0x1:0x2:3"), None);
        assert_eq!(
            l.head(0xffff_ffff_81c0_0080 + 0x1e00_0000),
            0xffff_ffff_a080_0000
        );
    }

    #[test]
    fn a_broken_back_link_or_a_cycle_stops_the_walk() {
        let mut mem = Memory::default();
        let addrs = module_list(&mut mem, &["a", "b", "c"]);
        mem.put_u64(addrs[2] + 8 + 8, 0xffff_ffff_c000_9008);
        let (got, w) = names(&mem, 1000);
        assert_eq!((got.len(), w.stop), (2, Some(Stop::Malformed)));
        // A node whose next is itself (and whose prev agrees): bounded by MAX_MODULES or the
        // budget.
        let mut mem = Memory::default();
        let addrs = module_list(&mut mem, &["loop"]);
        mem.put_u64(addrs[0] + 8, addrs[0] + 8);
        mem.put_u64(addrs[0] + 16, addrs[0] + 8);
        let (_, w) = names(&mem, 1_000_000);
        assert_eq!(w.stop, Some(Stop::Malformed));
    }

    proptest! {
        #[test]
        fn garbage_is_bounded(
            words in prop::collection::vec(prop_oneof![
                any::<u64>(),
                (0u64..8).prop_map(|i| 0xffff_ffff_c000_0008 + 0x1000 * i),
                Just(HEAD),
            ], 0..600),
            budget in 1u32..3000,
        ) {
            let mut mem = Memory::default();
            mem.zero(HEAD, 16);
            for (i, w) in words.iter().enumerate() {
                let page = 0xffff_ffff_c000_0000 + 0x1000 * (i as u64 % 8);
                mem.put_u64(page + 8 * (i as u64 / 8 % 64), *w);
            }
            mem.put_u64(HEAD, words.first().copied().unwrap_or(HEAD));
            let (got, w) = names(&mem, budget);
            prop_assert!(mem.reads.get() <= u64::from(budget));
            prop_assert!(got.len() as u32 <= MAX_MODULES);
            prop_assert_eq!(got.len() as u32, w.modules);
        }
    }
}
