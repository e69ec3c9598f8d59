//! Values numbered in the order they are first seen, each kept once: the index holds their
//! numbers, found by the value's hash and compared with the list's (no second copy of a value
//! as a map key). The pprof export's string table, the Firefox export's per-thread ones, and
//! the distinct named call chains.

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash};

/// The values, in the order first seen (a string table's `T`: owned, or borrowed from the
/// profile).
pub struct Interner<T> {
    pub values: Vec<T>,
    index: hashbrown::HashTable<u32>,
}

/// A value's hash: foldhash with a fixed seed (deterministic). Hundreds of thousands of names
/// that differ in their last hex digits: measured faster here than FxHash.
fn hash<K: Hash + ?Sized>(k: &K) -> u64 {
    foldhash::fast::FixedState::default().hash_one(k)
}

impl<T> Interner<T> {
    /// An empty table with room for `n` values.
    pub fn with_capacity(n: usize) -> Self {
        Interner {
            values: Vec::with_capacity(n),
            index: hashbrown::HashTable::with_capacity(n),
        }
    }

    /// The number of `key`, and whether it is new: then `make` gives what the table keeps of it.
    pub fn number<K>(&mut self, key: &K, make: impl FnOnce() -> T) -> (u32, bool)
    where
        K: Hash + Eq + ?Sized,
        T: Borrow<K>,
    {
        let h = hash(key);
        match self.find(h, key) {
            Some(i) => (i, false),
            None => (self.add::<K>(h, make()), true),
        }
    }

    /// The number of the value equal to `key`, whose hash is `h`.
    #[inline]
    fn find<K>(&self, h: u64, key: &K) -> Option<u32>
    where
        K: Eq + ?Sized,
        T: Borrow<K>,
    {
        let values = &self.values;
        self.index
            .find(h, |&i| values[i as usize].borrow() == key)
            .copied()
    }

    /// Adds `value`, new, whose hash (as a `K`) is `h`; returns its number.
    #[inline]
    fn add<K>(&mut self, h: u64, value: T) -> u32
    where
        K: Hash + ?Sized,
        T: Borrow<K>,
    {
        let i = self.values.len() as u32;
        self.values.push(value);
        let values = &self.values;
        self.index
            .insert_unique(h, i, |&j| hash::<K>(values[j as usize].borrow()));
        i
    }
}

impl<T: Hash + Eq> Interner<T> {
    /// The number of `value`, and whether it is new (then the table keeps `value` itself, not
    /// a copy). `T`'s hash must be that of the form [`Interner::number`] is asked with (as a
    /// `Cow<str>`'s is its `str`'s).
    pub fn number_owned(&mut self, value: T) -> (u32, bool) {
        let h = hash(&value);
        match self.find(h, &value) {
            Some(i) => (i, false),
            None => (self.add::<T>(h, value), true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Interner;

    /// Numbers by first sight, one entry per distinct string.
    #[test]
    fn strings_are_numbered_once_in_order() {
        let mut t: Interner<String> = Interner::with_capacity(0);
        let words = ["b", "a", "b", "", "a", "c", ""];
        let got: Vec<(u32, bool)> = words
            .iter()
            .map(|w| t.number(*w, || w.to_string()))
            .collect();
        assert_eq!(
            got,
            [
                (0, true),
                (1, true),
                (0, false),
                (2, true),
                (1, false),
                (3, true),
                (2, false)
            ]
        );
        assert_eq!(t.values, ["b", "a", "", "c"]);
    }
}
