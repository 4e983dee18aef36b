//! SSRF guard: a `callbackUrl` comes from a connector and a `forward_url` from config, and
//! neither may make callbackd call into its own network (loopback, private ranges, link-local,
//! the cloud metadata address, reserved and special-purpose ranges). Checked at hand-off (a
//! clear 400) and again at delivery, on the addresses DNS actually returned, through the HTTP
//! client's resolver: a name that resolved to a public address at hand-off and to 127.0.0.1
//! later is still refused. `dispatch.allow_private_networks` opens it for `callbackUrl`s,
//! `sources.<name>.allow_private_forward_url` for one source's `forward_url`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SsrfError {
    #[error("`{0}` is not an absolute http(s) URL")]
    BadUrl(String),
    /// The address is kept for logs; the message never shows it, so a caller cannot map the
    /// internal network through callbackd's resolver.
    #[error(
        "`{host}` is, or resolves to, a loopback, private, link-local or reserved address, \
         which callbackd does not call"
    )]
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

/// Every IPv4 range of the IANA special-purpose registry that is not globally reachable,
/// plus multicast and the 6to4 relay anycast block.
fn is_forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    ip.is_loopback() // 127.0.0.0/8
        || ip.is_private() // 10/8, 172.16/12, 192.168/16
        || ip.is_link_local() // 169.254/16, incl. the 169.254.169.254 metadata address
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast() // 224/4
        || ip.is_documentation() // 192.0.2/24, 198.51.100/24, 203.0.113/24
        || a == 0 // "this network", 0/8
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT, 100.64/10
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments, 192.0.0/24
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast, 192.88.99/24
        || (a == 198 && (b == 18 || b == 19)) // benchmarking, 198.18/15
        || a >= 240 // reserved, 240/4
}

fn is_forbidden_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = embedded_v4(ip) {
        return is_forbidden_v4(v4);
    }
    let s = ip.segments();
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast() // ff00::/8
        || (s[0] & 0xfe00) == 0xfc00 // unique local, fc00::/7 (incl. fd00:ec2::254 metadata)
        || (s[0] & 0xffc0) == 0xfe80 // link-local, fe80::/10
        || (s[0] & 0xffc0) == 0xfec0 // site-local, fec0::/10 (deprecated, still routable inside)
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation, 2001:db8::/32
        || (s[0] == 0x3fff && s[1] < 0x1000) // documentation, 3fff::/20
        || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments, 2001::/23 (Teredo, ORCHID, benchmarking)
        || s[0] == 0x2002 // 6to4, 2002::/16: reaches an IPv4 address through a relay
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]) // discard-only, 100::/64
        || (s[0] == 0x0064 && s[1] == 0xff9b && s[2] == 0x0001) // local-use NAT64, 64:ff9b:1::/48
        || s[0] == 0x5f00 // segment routing SIDs, 5f00::/16
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

/// The default refuses internal addresses: opening them is always a switch in the config.
#[derive(Debug, Clone, Copy, Default)]
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

    /// Each special-purpose range, by its first and last address, and the addresses just
    /// outside it, which are public and must stay reachable.
    #[test]
    fn forbidden_ranges() {
        let refused = [
            ("0.0.0.0", "0.255.255.255"),
            ("10.0.0.0", "10.255.255.255"),
            ("100.64.0.0", "100.127.255.255"),
            ("127.0.0.0", "127.255.255.255"),
            ("169.254.0.0", "169.254.255.255"),
            ("172.16.0.0", "172.31.255.255"),
            ("192.0.0.0", "192.0.0.255"),
            ("192.0.2.0", "192.0.2.255"),
            ("192.88.99.0", "192.88.99.255"),
            ("192.168.0.0", "192.168.255.255"),
            ("198.18.0.0", "198.19.255.255"),
            ("198.51.100.0", "198.51.100.255"),
            ("203.0.113.0", "203.0.113.255"),
            ("224.0.0.0", "239.255.255.255"),
            ("240.0.0.0", "255.255.255.255"),
            ("::", "::"),
            ("::1", "::1"),
            ("::ffff:127.0.0.1", "::ffff:10.255.255.255"),
            ("::127.0.0.1", "::169.254.169.254"),
            ("64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1"),
            ("64:ff9b:1::", "64:ff9b:1:ffff:ffff:ffff:ffff:ffff"),
            ("100::", "100::ffff:ffff:ffff:ffff"),
            ("2001::", "2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("2001:db8::", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("2002::", "2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("3fff::", "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("5f00::", "5f00:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("fc00::", "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("fd00:ec2::254", "fd00:ec2::254"),
            ("fe80::", "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("ff00::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
        ];
        for (first, last) in refused {
            for bad in [first, last] {
                assert!(
                    is_forbidden(bad.parse().unwrap()),
                    "{bad} should be refused"
                );
            }
        }
        let allowed = [
            "1.0.0.0",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.0.1.0",
            "192.0.3.0",
            "192.88.98.255",
            "192.88.100.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "198.51.99.255",
            "203.0.112.255",
            "223.255.255.255",
            "8.8.8.8",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2001:200::",
            "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001:db9::",
            "2003::",
            "2606:4700:4700::1111",
            "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "3fff:1000::",
            "4000::",
            "5eff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "5f01::",
            "fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ];
        for good in allowed {
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
            let err = guard.check_url(bad, t).await.unwrap_err();
            assert!(matches!(err, SsrfError::Forbidden { .. }), "{bad}");
        }
        // The message names the host it was given, never what the host resolved to.
        let err = guard
            .check_url("http://localhost:9/cb", t)
            .await
            .unwrap_err();
        let SsrfError::Forbidden { addr, .. } = &err else {
            panic!("{err}")
        };
        assert!(addr.is_loopback());
        let message = err.to_string();
        assert!(message.contains("`localhost`"), "{message}");
        assert!(!message.contains(&addr.to_string()), "{message}");
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
