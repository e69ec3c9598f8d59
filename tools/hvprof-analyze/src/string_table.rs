//! Strings numbered in the order they are first seen, each kept once: the index holds their
//! numbers, found by the string's hash and compared with the table's (no second copy of a string
//! as a map key). The pprof export's string table and the Firefox export's per-thread ones.

use std::hash::BuildHasher;

/// The strings, in the order first seen (`T`: owned, or borrowed from the profile).
pub struct StringTable<T> {
    pub strings: Vec<T>,
    index: hashbrown::HashTable<u32>,
}

/// A string's hash: foldhash with a fixed seed (deterministic). Hundreds of thousands of names
/// that differ in their last hex digits: measured faster here than FxHash.
fn hash(s: &str) -> u64 {
    foldhash::fast::FixedState::default().hash_one(s)
}

impl<T: AsRef<str>> StringTable<T> {
    /// An empty table with room for `n` strings.
    pub fn with_capacity(n: usize) -> Self {
        StringTable {
            strings: Vec::with_capacity(n),
            index: hashbrown::HashTable::with_capacity(n),
        }
    }

    /// The number of `s`, and whether it is new: then `make` gives what the table keeps of it.
    pub fn number(&mut self, s: &str, make: impl FnOnce() -> T) -> (u32, bool) {
        let h = hash(s);
        let strings = &self.strings;
        if let Some(&i) = self.index.find(h, |&i| strings[i as usize].as_ref() == s) {
            return (i, false);
        }
        let i = self.strings.len() as u32;
        self.strings.push(make());
        let strings = &self.strings;
        self.index
            .insert_unique(h, i, |&j| hash(strings[j as usize].as_ref()));
        (i, true)
    }
}

#[cfg(test)]
mod tests {
    use super::StringTable;

    /// Numbers by first sight, one entry per distinct string.
    #[test]
    fn strings_are_numbered_once_in_order() {
        let mut t: StringTable<String> = StringTable::with_capacity(0);
        let words = ["b", "a", "b", "", "a", "c", ""];
        let got: Vec<(u32, bool)> = words
            .iter()
            .map(|w| t.number(w, || w.to_string()))
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
        assert_eq!(t.strings, ["b", "a", "", "c"]);
    }
}
