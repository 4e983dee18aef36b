//! SSRF guard: a `callbackUrl` comes from a connector and a `forward_url` from config, and
//! neither may make callbackd call into its own network (loopback, private ranges, link-local,
//! the cloud metadata address). Checked at hand-off (a clear 400) and again at delivery, on
//! the addresses DNS actually returned, through the HTTP client's resolver: a name that
//! resolved to a public address at hand-off and to 127.0.0.1 later is still refused.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SsrfError {
    #[error("`{0}` is not an absolute http(s) URL")]
    BadUrl(String),
    #[error("{host} resolves to {addr}, a private, loopback or link-local address")]
    Forbidden { host: String, addr: IpAddr },
}

/// Error text the resolver uses, so delivery can classify the failure.
pub const REFUSED_ADDRESS: &str = "refused_address";

pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_forbidden_v4(v4),
        IpAddr::V6(v6) => is_forbidden_v6(v6),
    }
}

fn is_forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || a >= 240 // reserved
}

fn is_forbidden_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = embedded_v4(ip) {
        return is_forbidden_v4(v4);
    }
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local (incl. fd00:ec2::254 metadata)
        || (first & 0xffc0) == 0xfe80 // link-local
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated, still routable inside)
        || (first == 0x2001 && ip.segments()[1] == 0x0db8) // documentation
}

/// IPv4 hidden in IPv6: mapped (`::ffff:a.b.c.d`), compatible (`::a.b.c.d`) and NAT64
/// (`64:ff9b::a.b.c.d`) all reach the IPv4 address.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let tail = || Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !(s[6] == 0 && s[7] <= 1) {
        return Some(tail());
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return Some(tail());
    }
    None
}

#[derive(Debug, Clone, Copy)]
pub struct SsrfGuard {
    pub allow_private: bool,
}

impl SsrfGuard {
    /// Checks a target URL: scheme, literal addresses, and the addresses its host resolves to
    /// now. A name that does not resolve is allowed here (DNS may be briefly down; delivery
    /// checks again).
    pub async fn check_url(&self, raw: &str, dns_timeout: Duration) -> Result<Url, SsrfError> {
        let url = Url::parse(raw).map_err(|_| SsrfError::BadUrl(raw.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(SsrfError::BadUrl(raw.to_string()));
        }
        let host = url
            .host_str()
            .ok_or_else(|| SsrfError::BadUrl(raw.to_string()))?
            .to_string();
        if self.allow_private {
            return Ok(url);
        }
        let port = url.port_or_known_default().unwrap_or(443);
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return match is_forbidden(ip) {
                true => Err(SsrfError::Forbidden { host, addr: ip }),
                false => Ok(url),
            };
        }
        let lookup = tokio::time::timeout(dns_timeout, tokio::net::lookup_host((bare, port))).await;
        if let Ok(Ok(addrs)) = lookup {
            for addr in addrs {
                if is_forbidden(addr.ip()) {
                    return Err(SsrfError::Forbidden {
                        host: host.clone(),
                        addr: addr.ip(),
                    });
                }
            }
        }
        Ok(url)
    }

    /// A resolver for the delivery client that drops forbidden addresses, and fails when
    /// nothing is left.
    pub fn resolver(self) -> Arc<GuardedResolver> {
        Arc::new(GuardedResolver { guard: self })
    }
}

pub struct GuardedResolver {
    guard: SsrfGuard,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow_private = self.guard.allow_private;
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| allow_private || !is_forbidden(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!("{REFUSED_ADDRESS}: {host} has no permitted address").into());
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_ranges() {
        for bad in [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fc00::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "ff02::1",
        ] {
            assert!(
                is_forbidden(bad.parse().unwrap()),
                "{bad} should be refused"
            );
        }
        for good in [
            "8.8.8.8",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert!(
                !is_forbidden(good.parse().unwrap()),
                "{good} should be allowed"
            );
        }
    }

    #[tokio::test]
    async fn urls_are_checked_with_literals_and_names() {
        let guard = SsrfGuard {
            allow_private: false,
        };
        let t = Duration::from_secs(2);
        for bad in [
            "http://127.0.0.1/cb",
            "http://10.0.0.1/cb",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]:8080/cb",
            "http://[::ffff:127.0.0.1]/cb",
            "http://localhost:9/cb",
        ] {
            assert!(
                matches!(
                    guard.check_url(bad, t).await,
                    Err(SsrfError::Forbidden { .. })
                ),
                "{bad}"
            );
        }
        for bad in ["ftp://example.com/", "not a url", "/relative"] {
            assert!(
                matches!(guard.check_url(bad, t).await, Err(SsrfError::BadUrl(_))),
                "{bad}"
            );
        }
        assert!(
            guard
                .check_url("https://93.184.215.14/cb?X-VTEX-signature=a%2Fb", t)
                .await
                .is_ok()
        );
        let open = SsrfGuard {
            allow_private: true,
        };
        assert!(open.check_url("http://127.0.0.1/cb", t).await.is_ok());
    }
}
