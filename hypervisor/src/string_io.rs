//! INS and OUTS, with or without REP (SDM Vol. 2A "INS/INSB/INSW/INSD", Vol. 2B
//! "OUTS/OUTSB/OUTSW/OUTSD" and "REP/REPE/REPZ/REPNE/REPNZ"): the register arithmetic of a string
//! I/O instruction the hypervisor carries out for its guest. Pure: the exit handler
//! (`vmexit::io`) moves the data between the port and the guest's memory, element by element.
//!
//! - The index register (RDI for INS, RSI for OUTS) and the count (RCX, with REP) are used at the
//!   instruction's address size: 16, 32 or 64 bits. A 32-bit write zero-extends the register, a
//!   16-bit one keeps bits 63:16 (Vol. 1 §3.4.1.1).
//! - Each element moves the index by its size, down when RFLAGS.DF is set.
//! - With REP, a count of 0 moves nothing. An exit moves at most a given number of elements;
//!   when some are left, RIP stays at the instruction, which the guest executes again for the
//!   rest (a REP string instruction may be interrupted and resumed between iterations, Vol. 2B
//!   "REP": "the processor ... allows the instruction to be resumed").

/// One string I/O instruction as the exit describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StringIo {
    /// Element size in bytes: 1, 2 or 4.
    pub size: u8,
    /// Address size in bytes: 2, 4 or 8.
    pub address_bytes: u8,
    pub rep: bool,
    /// RFLAGS.DF: the index moves down.
    pub down: bool,
}

impl StringIo {
    /// The mask of the address size.
    #[must_use]
    pub fn mask(&self) -> u64 {
        match self.address_bytes {
            2 => 0xffff,
            4 => 0xffff_ffff,
            _ => u64::MAX,
        }
    }

    /// How many elements this exit moves: 1 without REP, else RCX at the address size, at most
    /// `max`.
    #[must_use]
    pub fn count(&self, rcx: u64, max: u64) -> u64 {
        if self.rep {
            (rcx & self.mask()).min(max)
        } else {
            1
        }
    }

    /// The offset (from the segment's base) of element `i` (0 first), given the index register.
    #[must_use]
    pub fn offset(&self, index: u64, i: u64) -> u64 {
        let step = i.wrapping_mul(u64::from(self.size));
        let at = if self.down {
            index.wrapping_sub(step)
        } else {
            index.wrapping_add(step)
        };
        at & self.mask()
    }

    /// The index register after `n` elements.
    #[must_use]
    pub fn advance(&self, index: u64, n: u64) -> u64 {
        self.write_sized(index, self.offset(index, n))
    }

    /// RCX after `n` elements of a REP instruction.
    #[must_use]
    pub fn count_down(&self, rcx: u64, n: u64) -> u64 {
        self.write_sized(rcx, (rcx & self.mask()).wrapping_sub(n))
    }

    /// Whether the instruction is done after `n` elements moved at RCX `rcx` (as before them):
    /// RIP moves past it; otherwise it runs again.
    #[must_use]
    pub fn done(&self, rcx: u64, n: u64) -> bool {
        !self.rep || (rcx & self.mask()) == n
    }

    /// `reg` with its address-size part replaced by `value`.
    fn write_sized(&self, reg: u64, value: u64) -> u64 {
        match self.address_bytes {
            2 => (reg & !0xffff) | (value & 0xffff),
            4 => value & 0xffff_ffff,
            _ => value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn io(size: u8, address_bytes: u8, rep: bool, down: bool) -> StringIo {
        StringIo {
            size,
            address_bytes,
            rep,
            down,
        }
    }

    #[test]
    fn one_element_without_rep() {
        let s = io(2, 8, false, false);
        assert_eq!(s.count(0, 100), 1);
        assert_eq!(s.advance(0x1000, 1), 0x1002);
        assert!(s.done(0, 1));
    }

    /// emulator.flat's `rep outsb` down: from the last byte to the first.
    #[test]
    fn rep_down_and_up() {
        let s = io(1, 8, true, true);
        assert_eq!(s.count(5, 4096), 5);
        assert_eq!(s.offset(0x2004, 4), 0x2000);
        assert_eq!(s.advance(0x2004, 5), 0x1fff);
        assert_eq!(s.count_down(5, 5), 0);
        let s = io(4, 8, true, false);
        assert_eq!(s.advance(0x3000, 3), 0x300c);
    }

    #[test]
    fn a_long_rep_goes_on_in_the_next_exit() {
        let s = io(1, 8, true, false);
        let n = s.count(10_000, 4096);
        assert_eq!(n, 4096);
        assert!(!s.done(10_000, n));
        assert_eq!(s.count_down(10_000, n), 10_000 - 4096);
        assert!(s.done(0, s.count(0, 4096)), "RCX 0: nothing to move");
    }

    /// The address size: 16-bit keeps the upper bits and wraps, 32-bit zero-extends.
    #[test]
    fn address_sizes() {
        let s = io(2, 2, true, false);
        assert_eq!(s.count(0xdead_0000_0003, 100), 3);
        assert_eq!(s.advance(0xdead_0000_fffe, 1), 0xdead_0000_0000);
        assert_eq!(s.count_down(0xdead_0000_0003, 3), 0xdead_0000_0000);
        let s = io(4, 4, true, false);
        assert_eq!(s.advance(0xdead_ffff_fffc, 1), 0);
        assert_eq!(s.count_down(0xdead_0000_0002, 1), 1);
        assert_eq!(s.offset(0xffff_fffc, 2), 4);
    }

    proptest! {
        /// Moving n elements and then m is moving n + m; RCX and the index stay within their
        /// address size's bits and keep the bits above as the size says.
        #[test]
        fn steps_compose(size in prop::sample::select(vec![1u8, 2, 4]),
                         address_bytes in prop::sample::select(vec![2u8, 4, 8]),
                         down: bool, index: u64, rcx: u64, n in 0u64..5000, m in 0u64..5000) {
            let s = io(size, address_bytes, true, down);
            prop_assert_eq!(s.advance(s.advance(index, n), m), s.advance(index, n + m));
            let after = s.count_down(rcx, n);
            match address_bytes {
                2 => prop_assert_eq!(after & !0xffff, rcx & !0xffff),
                4 => prop_assert_eq!(after >> 32, 0),
                _ => {}
            }
            let total = s.count(rcx, u64::MAX);
            prop_assert!(s.done(rcx, total));
            prop_assert_eq!(s.count_down(rcx, total) & s.mask(), 0);
        }
    }
}
