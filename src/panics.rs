//! A panic's message, as a caught panic's payload carries it (`panic!("...")` gives a `&str` or a `String`): for the
//! pipeline a panic stopped ([`crate::worker`]) and the schema a parser panicked on ([`crate::decode`]).

/// The message of a panic's `payload`, `None` when it carries none a person can read.
pub fn message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload.downcast_ref::<&str>().map(|s| (*s).to_owned()).or_else(|| payload.downcast_ref::<String>().cloned())
}
