//! Where validation reports its problems: each one names the field at fault, in the pipeline file's terms
//! (`source.queue`, `topics[0]`). A leaf: the configuration collects them with the file and the pipeline; the
//! connectors' own rules (a broker's `[source]`) report through it without knowing the configuration.

/// A sink for validation problems.
pub trait Problems {
    /// Records that `field` is wrong, and why.
    fn push(&mut self, field: &str, message: impl Into<String>);
    /// How many problems were recorded so far (a rule that only applies to an otherwise valid file asks it).
    fn count(&self) -> usize;
}
