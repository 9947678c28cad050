//! What the stores say when `idemflow pipeline rename` is refused ([`crate::store::Store::rename_pipeline`]), written
//! once for every store that can rename.

/// A rename is refused while a lane of the old name recorded a batch attempt this recently (a worker running).
pub const RUNNING_WITHIN: std::time::Duration = super::contract::FORGET_REFUSED_WITHIN;

/// The refusal while a worker of `old` runs: `lanes` are its lanes' attempts (`<owner> at <time>`).
pub fn running(old: &str, lanes: &[String]) -> String {
    format!(
        "a worker of pipeline {old:?} ran a batch within the last {}s ({}): stop every worker of the pipeline, wait {}s, and \
         run this again (a batch in flight would go on writing under the old name)",
        RUNNING_WITHIN.as_secs(),
        lanes.join(", "),
        RUNNING_WITHIN.as_secs()
    )
}

/// The refusal where `new` already has rows in `table`.
pub fn taken(new: &str, table: &str) -> String {
    format!("pipeline {new:?} already has a history (rows in {table}): a rename never merges two histories; pick another name")
}
