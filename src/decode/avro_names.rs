//! Avro names as Java's Avro reads them, installed into the `apache-avro` crate before any schema is parsed.
//!
//! The Avro specification allows names of `[A-Za-z_][A-Za-z0-9_]*`; Java's implementation (and so Confluent's
//! schema registry, the serializers, and Debezium with its default name handling) accepts any Unicode letter or
//! `_` first and letters, digits or `_` after (`org.apache.avro.Schema.validateName`: `Character.isLetter`,
//! `isLetterOrDigit`), so a record named `Überweisung` is registered and produced. `apache-avro` 0.21 checks the
//! specification's rule and, for a type's name, unwraps the result: such a schema panicked. Here every name a schema
//! holds (a type's name and namespace, a field's name, an enum's symbol) follows Java's rule instead; the crate lets
//! a validator of each kind be installed once per process ([`apache_avro::validator`]).

use apache_avro::error::Details;
use apache_avro::schema::Namespace;
use apache_avro::validator::{
    EnumSymbolNameValidator, RecordFieldNameValidator, SchemaNameValidator, SchemaNamespaceValidator,
};
use apache_avro::AvroResult;

/// The rule, in words, for error messages.
const RULE: &str = "a letter or _ first, then letters, digits or _ (Java's Avro rule)";

/// Java's rule for one name (no dots).
pub fn java_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_alphabetic() || c == '_') && chars.all(|c| c.is_alphanumeric() || c == '_')
}

/// A namespace: empty, or names separated by dots.
fn java_namespace(ns: &str) -> bool {
    ns.is_empty() || ns.split('.').all(java_name)
}

/// The validators of Java's names.
struct JavaNames;

impl SchemaNameValidator for JavaNames {
    fn validate(&self, full: &str) -> AvroResult<(String, Namespace)> {
        let (namespace, name) = match full.rsplit_once('.') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, full),
        };
        if !java_name(name) || !namespace.is_none_or(java_namespace) {
            return Err(Details::InvalidSchemaName(full.to_owned(), RULE).into());
        }
        Ok((name.to_owned(), namespace.map(str::to_owned)))
    }
}

impl SchemaNamespaceValidator for JavaNames {
    fn validate(&self, ns: &str) -> AvroResult<()> {
        if java_namespace(ns) {
            Ok(())
        } else {
            Err(Details::InvalidNamespace(ns.to_owned(), RULE).into())
        }
    }
}

impl RecordFieldNameValidator for JavaNames {
    fn validate(&self, name: &str) -> AvroResult<()> {
        if java_name(name) {
            Ok(())
        } else {
            Err(Details::FieldName(name.to_owned()).into())
        }
    }
}

impl EnumSymbolNameValidator for JavaNames {
    fn validate(&self, symbol: &str) -> AvroResult<()> {
        if java_name(symbol) {
            Ok(())
        } else {
            Err(Details::EnumSymbolName(symbol.to_owned()).into())
        }
    }
}

/// Installs Java's rules, once per process (later calls do nothing). Called before every schema is parsed
/// ([`super::avro::AvroSchema::parse`]).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Each setter fails only if a validator of its kind is installed already: the crate's own default is
        // installed at its first use, and nothing here parses a schema before this runs.
        let installed = [
            apache_avro::validator::set_schema_name_validator(Box::new(JavaNames)).is_ok(),
            apache_avro::validator::set_schema_namespace_validator(Box::new(JavaNames)).is_ok(),
            apache_avro::validator::set_record_field_name_validator(Box::new(JavaNames)).is_ok(),
            apache_avro::validator::set_enum_symbol_name_validator(Box::new(JavaNames)).is_ok(),
        ];
        if installed.contains(&false) {
            tracing::warn!("Avro names: the specification's ASCII rule stays in force (a schema was parsed before Java's rule was installed)");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_javas_rule() {
        for good in ["Überweisung", "_x", "a1", "名前", "zahlung_ß"] {
            assert!(java_name(good), "{good}");
        }
        for bad in ["", "1a", "a-b", "a b", "a.b", "ü-x"] {
            assert!(!java_name(bad), "{bad}");
        }
        assert!(java_namespace("de.bank.überweisungen"));
        assert!(!java_namespace("de..bank"));
    }
}
