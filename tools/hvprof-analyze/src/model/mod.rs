//! The capture's model: its samples decoded, classified and counted, their stacks named, read
//! again in time order.

pub mod calls;
pub mod capture;
pub mod cost;
pub mod integrity;
pub mod interner;
pub mod losses;
pub(crate) mod merge;
pub mod par;
pub mod profile;
pub mod progress;
pub(crate) mod stack_table;
pub mod timeline;
pub mod whole_stack;
pub mod window;
