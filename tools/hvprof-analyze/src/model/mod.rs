//! The capture's model: its samples decoded, classified and counted, their stacks named, read
//! again in time order.

pub mod calls;
pub mod capture;
pub mod cost;
pub mod interner;
pub(crate) mod merge;
pub mod par;
pub mod profile;
pub mod progress;
pub(crate) mod stack_table;
pub mod timeline;
pub mod window;
