//! The members of the rate-limit fields tollgate sends (`RateLimit`, `RateLimit-Policy`:
//! structured-field lists of `"<name>";<key>=<integer>...`), parsed for assertions.

/// One member of a structured-field list: its name and its integer parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub params: Vec<(String, u64)>,
}

impl Member {
    pub fn param(&self, key: &str) -> u64 {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("member {} has no parameter {key}: {self:?}", self.name))
    }
}

/// Parses `"a";q=5;w=60, "b";q=1;w=60` into its members.
pub fn members(field: &str) -> Vec<Member> {
    field
        .split(',')
        .map(|member| {
            let mut parts = member.trim().split(';');
            let name = parts.next().expect("member name").trim();
            assert!(
                name.len() >= 2 && name.starts_with('"') && name.ends_with('"'),
                "member name is not a quoted string: {field}"
            );
            let params = parts
                .map(|p| {
                    let (k, v) = p
                        .split_once('=')
                        .unwrap_or_else(|| panic!("parameter without value in {field}"));
                    let v: u64 = v
                        .trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("non-integer parameter {k} in {field}"));
                    (k.trim().to_string(), v)
                })
                .collect();
            Member {
                name: name[1..name.len() - 1].to_string(),
                params,
            }
        })
        .collect()
}
