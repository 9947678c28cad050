//! Placeholders in a target's text (a URL, a header value, a topic, a body string): `{name}` names a
//! `[sink.params]` entry, `{{` and `}}` are braces ([`crate::store::redis_command::parse_arg`]). Shared by the
//! targets' grammar ([`super::spec`]) and the body's ([`super::body`]).

use crate::store::redis_command::{parse_arg, Arg};

/// `text` as a template whose placeholders must each name a `[sink.params]` entry (`known`); each problem to
/// `problem`, never quoting the text. `None` when it does not parse (a placeholder unknown is reported, the template kept).
pub fn template(text: &str, known: &dyn Fn(&str) -> bool, problem: &mut dyn FnMut(String)) -> Option<Arg> {
    match parse_arg(text) {
        Ok(arg) => {
            for p in arg.params().filter(|p| !known(p)) {
                problem(format!("{{{p}}} is used but has no entry in [sink.params]"));
            }
            Some(arg)
        }
        // The parser's words quote the text, which may hold a credential: said again without it.
        Err(why) => {
            let what = if why.contains("without its '}'") {
                "a '{' without its '}'"
            } else if why.contains("without its '{'") {
                "a '}' without its '{'"
            } else {
                "a {...} that is not a placeholder (a [sink.params] name: letters, digits, _)"
            };
            problem(format!("does not read as a template: {what}; write {{{{ and }}}} for literal braces (the value is not shown: it may hold a credential)"));
            None
        }
    }
}
