//! Test support: the keys a serde type accepts, next to the keys a document has. The document
//! is deserialized through a wrapper that records the field list every struct hands to
//! `deserialize_struct`: serde's own list, so it follows renames and needs no list kept by hand,
//! and it reaches every struct the document reaches (a struct the document leaves out shows as
//! its missing key one level up).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};

/// Key paths like `tftp.timeout`: `[]` stands for any element of a list and `*` for any key of
/// a map (`dhcp.subnets[].pools`, `profiles.*.kernel`).
#[derive(Debug, Default)]
pub struct Keys {
    /// Every field of every struct the document reached.
    pub accepted: BTreeSet<String>,
    /// The keys the document has.
    pub present: BTreeSet<String>,
}

/// Deserializes a `T` from YAML `text`, recording the keys.
pub fn keys<T: DeserializeOwned>(text: &str) -> Result<Keys, serde_norway::Error> {
    let keys = RefCell::new(Keys::default());
    let tracer = Tracer { inner: serde_norway::Deserializer::from_str(text), at: At::root(&keys) };
    T::deserialize(tracer)?;
    Ok(keys.into_inner())
}

/// Where in the document, and the record to add to.
#[derive(Clone)]
struct At<'k> {
    path: String,
    keys: &'k RefCell<Keys>,
}

impl<'k> At<'k> {
    fn root(keys: &'k RefCell<Keys>) -> Self {
        Self { path: String::new(), keys }
    }

    fn child(&self, name: &str) -> Self {
        let path =
            if self.path.is_empty() { name.to_owned() } else { format!("{}.{name}", self.path) };
        Self { path, keys: self.keys }
    }
}

struct Tracer<'k, D> {
    inner: D,
    at: At<'k>,
}

/// Whether a map's keys are field names (a struct) or data (a map, like `profiles`).
#[derive(Clone, Copy)]
enum Keyed {
    Fields,
    Data,
}

macro_rules! forward_deserialize {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Self::Error> {
            self.inner.$method($($arg,)* Wrap { inner: visitor, at: self.at, keyed: Keyed::Fields })
        }
    )*};
}

impl<'de, D: de::Deserializer<'de>> de::Deserializer<'de> for Tracer<'_, D> {
    type Error = D::Error;

    forward_deserialize! {
        deserialize_any(); deserialize_bool(); deserialize_i8(); deserialize_i16();
        deserialize_i32(); deserialize_i64(); deserialize_u8(); deserialize_u16();
        deserialize_u32(); deserialize_u64(); deserialize_f32(); deserialize_f64();
        deserialize_char(); deserialize_str(); deserialize_string(); deserialize_bytes();
        deserialize_byte_buf(); deserialize_option(); deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str); deserialize_seq();
        deserialize_tuple(len: usize); deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier(); deserialize_ignored_any();
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.inner.deserialize_map(Wrap { inner: visitor, at: self.at, keyed: Keyed::Data })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        let mut keys = self.at.keys.borrow_mut();
        keys.accepted.extend(fields.iter().map(|f| self.at.child(f).path));
        drop(keys);
        let visitor = Wrap { inner: visitor, at: self.at, keyed: Keyed::Fields };
        self.inner.deserialize_struct(name, fields, visitor)
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// A visitor that keeps tracing whatever it is handed.
struct Wrap<'k, V> {
    inner: V,
    at: At<'k>,
    keyed: Keyed,
}

macro_rules! forward_visit {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit! {
        visit_bool(bool); visit_i8(i8); visit_i16(i16); visit_i32(i32); visit_i64(i64);
        visit_i128(i128); visit_u8(u8); visit_u16(u16); visit_u32(u32); visit_u64(u64);
        visit_u128(u128); visit_f32(f32); visit_f64(f64); visit_char(char); visit_str(&str);
        visit_borrowed_str(&'de str); visit_string(String); visit_bytes(&[u8]);
        visit_borrowed_bytes(&'de [u8]); visit_byte_buf(Vec<u8>);
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_some(Tracer { inner: d, at: self.at })
    }

    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_newtype_struct(Tracer { inner: d, at: self.at })
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let at = At { path: format!("{}[]", self.at.path), keys: self.at.keys };
        self.inner.visit_seq(Seq { inner: seq, at })
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.inner.visit_map(Map { inner: map, at: self.at, keyed: self.keyed, value_at: None })
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        // The enums of the configuration are plain words: nothing inside to trace.
        self.inner.visit_enum(data)
    }
}

/// A value about to be deserialized at `at`.
struct Seed<'k, S> {
    inner: S,
    at: At<'k>,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Tracer { inner: d, at: self.at })
    }
}

struct Seq<'k, A> {
    inner: A,
    at: At<'k>,
}

impl<'de, A: de::SeqAccess<'de>> de::SeqAccess<'de> for Seq<'_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.inner.next_element_seed(Seed { inner: seed, at: self.at.clone() })
    }
}

struct Map<'k, A> {
    inner: A,
    at: At<'k>,
    keyed: Keyed,
    /// Where the value of the key just read goes.
    value_at: Option<At<'k>>,
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for Map<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        // Every key in the configuration is a string: read it as one, note it, hand it on.
        let Some(key) = self.inner.next_key::<String>()? else { return Ok(None) };
        let at = self.at.child(match self.keyed {
            Keyed::Fields => &key,
            Keyed::Data => "*",
        });
        self.at.keys.borrow_mut().present.insert(at.path.clone());
        self.value_at = Some(at);
        seed.deserialize(<String as IntoDeserializer<'de, A::Error>>::into_deserializer(key))
            .map(Some)
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        let at = self.value_at.take().expect("serde asks for a value after its key");
        self.inner.next_value_seed(Seed { inner: seed, at })
    }
}
