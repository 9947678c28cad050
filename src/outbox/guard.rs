//! What a record may steer in a request, and what it may not: the operator's hosts, topics and credentials stay the
//! operator's whatever a record's values hold (docs/security.md, "The outbox").
//!
//! - A URL's scheme and authority (host, port, user) come from the pipeline file. A template with a placeholder
//!   there (or glued to the host: `https://api.example.com{v}/x`) needs `allow_hosts`, and every host a record
//!   renders is checked against it when the record is prepared and again when the request is sent ([`HostRule`]).
//! - A host that comes from a record must resolve to public addresses only (not loopback, private, link-local,
//!   CGNAT, unique local, multicast, or those hidden in IPv4-mapped and NAT64 forms), IP literals included, unless
//!   `allow_private_addresses = true` ([`public`], [`PublicOnly`]).
//! - A placeholder that is a whole path segment renders one segment: a value that is empty or a dot segment (`.`,
//!   `..`) is refused, and the rendered path keeps the template's segments, its literal ones unchanged
//!   ([`PathShape`]).
//! - A templated Kafka topic must be one of `allow_topics` (names, or prefixes ending in `*`) ([`TopicRule`]).
//! - A row's request goes only to the origin it was written for: a row whose origin is not the target's current one
//!   (written under an older configuration) is not sent with today's credentials ([`Origin`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// `allow_hosts`: exact host names (`api.example.com`), or suffixes on a dot boundary (`.example.com` allows
/// `a.example.com` and `b.a.example.com`, not `example.com` or `badexample.com`). Compared in lower case, after the
/// URL parser's own normalisation (IDNA, percent-decoding, numeric IPv4 forms).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostRule {
    exact: Vec<String>,
    suffixes: Vec<String>,
}

impl HostRule {
    /// The rule of `allow_hosts` as written.
    ///
    /// Errors: an entry that is empty, holds a scheme, a port, a path or a placeholder, or is a bare `.`.
    pub fn parse(entries: &[String]) -> Result<HostRule, String> {
        let mut rule = HostRule::default();
        for entry in entries {
            let lower = entry.trim().to_ascii_lowercase();
            let name = lower.strip_prefix('.').unwrap_or(&lower);
            let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || !c.is_ascii());
            if !plain || name.starts_with('.') || name.ends_with('.') || name.contains("..") {
                return Err(format!(
                    "{entry:?} is not a host name or a .suffix (write api.example.com, or .example.com for its subdomains; no scheme, port or path)"
                ));
            }
            // As the URL parser writes a host (IDNA: `bücher.example` is `xn--bcher-kva.example`).
            let ascii = match url::Host::parse(name) {
                Ok(url::Host::Domain(d)) => d,
                Ok(other) => other.to_string(),
                Err(_) => return Err(format!("{entry:?} is not a host name or a .suffix")),
            };
            if lower.starts_with('.') {
                rule.suffixes.push(format!(".{ascii}"));
            } else {
                rule.exact.push(ascii);
            }
        }
        Ok(rule)
    }

    /// Whether `host` (as the URL parser gives it) is allowed.
    pub fn allows(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.exact.iter().any(|e| *e == host) || self.suffixes.iter().any(|s| host.len() > s.len() && host.ends_with(s.as_str()))
    }

    /// Whether no entry was given.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.suffixes.is_empty()
    }
}

/// `allow_topics`: exact topic names, or prefixes ending in `*` (`tenant-*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicRule {
    exact: Vec<String>,
    prefixes: Vec<String>,
}

impl TopicRule {
    /// The rule of `allow_topics` as written.
    ///
    /// Errors: an empty entry, or a `*` anywhere but at the end.
    pub fn parse(entries: &[String]) -> Result<TopicRule, String> {
        let mut rule = TopicRule::default();
        for entry in entries {
            match entry.strip_suffix('*') {
                Some(prefix) if !prefix.is_empty() && !prefix.contains('*') => rule.prefixes.push(prefix.to_owned()),
                None if !entry.is_empty() && !entry.contains('*') => rule.exact.push(entry.clone()),
                _ => return Err(format!("{entry:?} is not a topic name or a prefix ending in * (orders-*)")),
            }
        }
        Ok(rule)
    }

    /// Whether `topic` is allowed.
    pub fn allows(&self, topic: &str) -> bool {
        self.exact.iter().any(|e| e == topic) || self.prefixes.iter().any(|p| topic.starts_with(p.as_str()))
    }

    /// Whether no entry was given.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.prefixes.is_empty()
    }
}

/// Whether `ip` is a public address: not unspecified, loopback, private (RFC 1918), link-local, shared (CGNAT,
/// RFC 6598), benchmarking, documentation, reserved, broadcast, multicast, unique local (RFC 4193), or an IPv4
/// address of those kinds in an IPv4-mapped, IPv4-compatible, NAT64 (RFC 6052) or 6to4 form.
pub fn public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => public_v4(v4),
        IpAddr::V6(v6) => public_v6(v6),
    }
}

fn public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && ip.octets()[2] == 0)
        || (a == 198 && (b == 18 || b == 19))
        || a >= 240)
}

fn public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return public_v4(v4);
    }
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from(((u32::from(hi)) << 16) | u32::from(lo));
    // IPv4-compatible (::a.b.c.d, deprecated), NAT64 (64:ff9b::/96), 6to4 (2002::/16).
    if s[..6] == [0; 6] && !(ip.is_unspecified() || ip.is_loopback()) {
        return public_v4(embedded(s[6], s[7]));
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4] {
        return public_v4(embedded(s[6], s[7]));
    }
    // The local-use NAT64 prefix (RFC 8215, 64:ff9b:1::/48): its IPv4 address sits where the network chose; none of
    // it is public.
    if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        return false;
    }
    if s[0] == 0x2002 {
        return public_v4(embedded(s[1], s[2]));
    }
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (s[0] & 0xfe00) == 0xfc00
        || (s[0] & 0xffc0) == 0xfe80
        || (s[0] & 0xffc0) == 0xfec0
        || s[0] == 0x2001 && s[1] == 0x0db8
        || s[0] == 0x0100 && s[1..4] == [0; 3])
}

/// A host a record rendered, checked before a request goes out: an IP literal must be public unless
/// `private_ok`; a name is left to [`PublicOnly`] (resolved at connection time).
///
/// Errors: why the host is refused.
pub fn check_literal(host: &url::Host<&str>, private_ok: bool) -> Result<(), String> {
    let ip = match host {
        url::Host::Ipv4(v4) => IpAddr::V4(*v4),
        url::Host::Ipv6(v6) => IpAddr::V6(*v6),
        url::Host::Domain(_) => return Ok(()),
    };
    if private_ok || public(ip) {
        Ok(())
    } else {
        Err(format!("{ip} is not a public address (set allow_private_addresses = true for internal targets)"))
    }
}

/// A DNS resolver for targets whose host comes from a record: resolves as the system does, then keeps only public
/// addresses ([`public`]), so a name under an allowed suffix that points at a private address (DNS rebinding, a
/// tenant's record) is never connected to. No address left is a connection error (retried, then a dead letter).
#[derive(Clone, Debug, Default)]
pub struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let kept: Vec<std::net::SocketAddr> = found.iter().copied().filter(|a| public(a.ip())).collect();
            if kept.is_empty() {
                let why = format!("{host} resolves to no public address ({} found; set allow_private_addresses = true for internal targets)", found.len());
                return Err(Box::new(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(kept.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// An origin: scheme, host and port (the port the scheme implies when none is written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin(pub String);

impl Origin {
    /// The origin of `url`, `None` for a URL that does not parse or has no host.
    pub fn of(url: &str) -> Option<Origin> {
        let u = url::Url::parse(url).ok()?;
        let host = u.host_str()?;
        Some(Origin(format!("{}://{}:{}", u.scheme(), host.to_ascii_lowercase(), u.port_or_known_default()?)))
    }
}

/// The path of a URL template with every placeholder written as a marker: which segments are literal, and how
/// many there are, to hold a rendered URL's path to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathShape {
    /// Each segment: its text when it holds no placeholder, `None` otherwise.
    segments: Vec<Option<String>>,
}

/// What stands for a placeholder when a template's shape is read.
pub const MARK: &str = "idemflowplaceholder";

impl PathShape {
    /// The shape of `sample` (the template with every placeholder as [`MARK`]); `None` when it does not parse.
    pub fn of(sample: &str) -> Option<PathShape> {
        let u = url::Url::parse(sample).ok()?;
        let segments = u.path_segments()?.map(|s| (!s.contains(MARK)).then(|| s.to_owned())).collect();
        Some(PathShape { segments })
    }

    /// Whether `rendered` (the URL with the record's values) has this shape: as many segments, the literal ones
    /// unchanged, and none empty that held a placeholder.
    ///
    /// Errors: what changed, without the values.
    pub fn check(&self, rendered: &url::Url) -> Result<(), String> {
        let Some(got) = rendered.path_segments() else { return Err("the values leave the URL without a path".to_owned()) };
        let got: Vec<&str> = got.collect();
        if got.len() != self.segments.len() {
            return Err(format!(
                "the values make the path {} segments long instead of {} (a value that is empty, '.' or '..' is not one path segment)",
                got.len(),
                self.segments.len()
            ));
        }
        for (i, (want, have)) in self.segments.iter().zip(&got).enumerate() {
            match want {
                Some(text) if text != have => return Err(format!("the values change the path's literal segment {} ({text:?})", i + 1)),
                None if have.is_empty() => return Err(format!("the values leave path segment {} empty", i + 1)),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Whether a placeholder's value, percent-encoded for a URL, is refused as a whole path segment: empty, or a dot
/// segment (`.`, `..`, and their percent-encoded forms, which URL parsers treat alike: WHATWG URL, "single-dot
/// segment").
pub fn dot_segment(encoded: &str) -> bool {
    let lower = encoded.to_ascii_lowercase().replace("%2e", ".");
    lower.is_empty() || lower == "." || lower == ".."
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_exactly_or_on_a_dot_boundary() {
        let rule = HostRule::parse(&["api.example.com".into(), ".hooks.example.org".into()]).unwrap();
        assert!(rule.allows("api.example.com") && rule.allows("API.example.com."));
        assert!(rule.allows("a.hooks.example.org") && rule.allows("b.a.hooks.example.org"));
        for refused in ["hooks.example.org", "evilhooks.example.org", "api.example.com.evil.com", "example.com", "127.0.0.1"] {
            assert!(!rule.allows(refused), "{refused}");
        }
        let idna = HostRule::parse(&["bücher.example".into()]).unwrap();
        assert!(idna.allows("xn--bcher-kva.example"), "entries are compared as the URL parser writes hosts");
        for bad in ["", ".", "https://x.com", "x.com:443", "x.com/a", "{host}.x.com", "x..com"] {
            assert!(HostRule::parse(&[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn topics_match_exactly_or_by_prefix() {
        let rule = TopicRule::parse(&["payments".into(), "tenant-*".into()]).unwrap();
        assert!(rule.allows("payments") && rule.allows("tenant-a"));
        assert!(!rule.allows("payments2") && !rule.allows("_schemas") && !rule.allows("connect-configs"));
        assert!(TopicRule::parse(&["a*b".into()]).is_err() && TopicRule::parse(&["*".into()]).is_err());
    }

    #[test]
    fn private_and_special_addresses_are_not_public() {
        for private in [
            "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1",
            "255.255.255.255", "::1", "::", "fc00::1", "fd12::1", "fe80::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe", "64:ff9b:1::a9fe:a9fe", "2002:7f00:1::", "::7f00:1", "ff02::1",
        ] {
            assert!(!public(private.parse().unwrap()), "{private}");
        }
        for open in ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(public(open.parse().unwrap()), "{open}");
        }
    }

    #[test]
    fn a_path_keeps_its_segments() {
        let shape = PathShape::of(&format!("http://h/v1/accounts/{MARK}/charges")).unwrap();
        let ok = url::Url::parse("http://h/v1/accounts/a%2Fb/charges").unwrap();
        assert!(shape.check(&ok).is_ok());
        for moved in ["http://h/v1/charges", "http://h/v1/accounts/charges", "http://h/v1/accounts//charges"] {
            assert!(shape.check(&url::Url::parse(moved).unwrap()).is_err(), "{moved}");
        }
        assert!(dot_segment("") && dot_segment(".") && dot_segment("..") && dot_segment("%2E%2e") && !dot_segment("..."));
    }
}
