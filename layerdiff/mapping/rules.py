"""Mapping files: how a port's site and parameter names correspond to the reference's.

One mapping serves the diff (pairing sites) and ``capture --weights-from`` (loading weights).
A TOML file (YAML with the same keys works too)::

    version = 1

    # Module renames, tried in order. Globs: '*' matches any run of characters and what it
    # matched fills the port side's '*' in order. Call numbers carry over (#0 -> #0).
    [[site]]
    reference = "encoder.layers.*.norm1"
    port = "enc.*.ln1"

    [[site]]                      # or a regular expression (whole names), \\1 .. on the port side
    reference_regex = '^decoder\\.layers\\.(\\d+)$'
    port = 'dec.\\1'
    args = { "1" = "2" }          # reference argument -> port argument, where they differ

    [[site]]
    reference = "transformer.h.*.attn"
    port = "transformer.h.*.attn"
    args = { past_key_values = "" }   # "": the port has no such argument; replay drops it

    [[site]]                      # code, run with a case file's trust (imported when used):
    reference = "model.layers.*.self_attn"
    port = "layers.*.attention"
    call = "my_port.adapters:attention_call"   # f(*args, **kwargs) -> (args, kwargs); the
                                               # whole port call, so such a rule takes no args
    outputs = { "0" = "0" }       # reference output -> port output, where they differ

    [[site]]                      # an output conversion: the port's outputs -> the reference's
    reference = "moe.experts"
    port = "moe.experts"
    output_transform = { function = "my_port.convert:weighted_sum", takes = ["0", "1"] }
    # or output_transform = "my_port.convert:f" (takes the port's output "0", gives "0")

    [[pair]]                      # one reference site with one port site (module#call)
    reference = "tgt_pos#0"
    port = "pos#1"

    [[unmatched]]                 # sites with no partner, and why: kept out of the fallback
    reference = "encoder.layers.*.self_attn.w_*"
    why = "the port fuses q, k, v and o into its attention module"

    [[unmatched]]                 # one input or output (and its gradient) without partner
    reference = "model.layers.*.self_attn"
    output = "1"

    [[param]]                     # port parameters made from reference parameters
    port = "enc.*.self_attn.in_proj_weight"
    reference = ["encoder.layers.*.self_attn.w_q.weight", "encoder.layers.*.self_attn.w_k.weight",
                 "encoder.layers.*.self_attn.w_v.weight"]
    transform = "concat"          # copy (default) | transpose | concat | split, or a list
    axis = 0                      # of them applied in order: ["concat", "transpose"], or
                                  # a conversion function "pkg.module:function" (tensor -> tensor)

    [[shard]]                     # multi-rank ports: how a tensor is cut across ranks
    site = "blocks.*.mlp.fc"      # glob over the port's module paths
    tensor = "weight"             # a parameter name, or "input" / "output" (every argument of
    dim = 0                       # that role; "input.1" one of them); the reference tensor is
                                  # cut into world-size equal parts along dim, rank r holds r

For ``split`` the port side is a list and the reference one tensor. A chain holds at most one
concat or split (it sets how many names each side has); ``axis`` is that step's. Parameters
that no ``[[param]]`` names follow their module: ``M.weight`` pairs with ``M'.weight`` when
modules ``M`` and ``M'`` are paired. A ``[[shard]]`` rule on a parameter covers its gradient
too; on "input" or "output" their gradients (``grad_input``, ``grad_output``). A tensor no rule
covers is replicated: every rank holds all of it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from layerdiff.config_file import ConfigFile
from layerdiff.errors import MappingError
from layerdiff.mapping.code import CodeRef, is_code
from layerdiff.mapping.params import TRANSFORMS, ParamSource
from layerdiff.mapping.pattern import Pattern

# the tail of an op site's name, <module site>/<op>#<k> (layerdiff.trace.schema, a floor up)
_OP_SITE = re.compile(r"#[0-9]+/[^/#]+#[0-9]+$")


@dataclass
class SiteRule:
    reference: Pattern
    port: str
    args: dict[str, str]
    line: int | None
    call: CodeRef | None = None          # a call adapter: reference arguments -> port call
    outputs: dict[str, str] = field(default_factory=dict)  # reference output -> port output
    output_transform: OutputConversion | None = None       # the port's outputs -> the reference's


@dataclass(frozen=True)
class OutputConversion:
    """``output_transform`` on a ``[[site]]`` or ``[[pair]]`` rule: ``function(*port outputs
    named by takes) -> tensor`` brings what the port site returns into the layout of the
    reference's output ``gives`` (compared by :mod:`layerdiff.compare.outconv`)."""

    code: CodeRef
    takes: tuple[str, ...] = ("0",)
    gives: str = "0"
    # the reference site's recorded inputs the function also takes, after the port's outputs:
    # what the port's layer never returns but the weighted sum needs (a gpt-fast experts
    # block returns each chosen expert's output; the routing weights are an input of HF's)
    reference_inputs: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        return self.code.spec

    @property
    def where(self) -> str:
        return self.code.where

    def resolve(self):
        """The function, imported now (see :meth:`CodeRef.resolve`)."""
        return self.code.resolve()

    def describe(self) -> str:
        return f"output conversion {self.spec}"


@dataclass(frozen=True)
class UnmatchedRecord:
    """One input or output of the sites a glob names that has no partner on the other side
    (``[[unmatched]]`` with ``input =`` or ``output =``): listed, never a reason not to judge."""

    side: str            # "reference" | "port"
    site: str            # a module glob, or a site glob with #call
    role: str            # "input" | "output" (their gradients follow)
    arg: str             # the argument path, e.g. "1" or "attention_mask"
    why: str

    def covers(self, site: str, role: str, arg: str) -> bool:
        side_role = {"grad_input": "input", "grad_output": "output"}.get(role, role)
        if side_role != self.role or not (arg == self.arg or arg.startswith(self.arg + ".")):
            return False
        module = site.rpartition("#")[0] or site
        return fnmatch.fnmatchcase(site, self.site) or fnmatch.fnmatchcase(module, self.site)


@dataclass
class ParamRule:
    port: list[Pattern]
    reference: list[str]
    transforms: tuple[str, ...]
    axis: int
    line: int | None


@dataclass
class ShardRule:
    site: Pattern        # over the port's module paths
    tensor: str          # parameter name, "input", "output", or "input.<arg>" / "output.<arg>"
    dim: int | None      # may count from the end (-1: the last dimension); None: partial
    line: int | None
    number: int = 0
    layout: str = "split"  # split | zigzag | partial | replicate | experts (SHARD_LAYOUTS)
    experts: tuple[tuple[int, ...], ...] = ()  # experts: the expert indices rank r holds
    over: str = ""  # the [mesh] dim whose ranks hold the parts; "": every rank (no mesh)

    def covers(self, module: str, role: str, arg: str) -> bool:
        if self.site.match(module) is None:
            return False
        if role in ("weight", "weight_grad"):
            return arg == self.tensor
        side = {"input": "input", "grad_input": "input", "output": "output",
                "grad_output": "output"}.get(role)
        return side is not None and self.tensor in (side, f"{side}.{arg}")

    def describe(self) -> str:
        words = [self.site.text, self.tensor]
        words += [] if self.layout == "split" else [self.layout]
        words += [] if self.dim is None else [f"dim {self.dim}"]
        words += [f"over {self.over}"] if self.over else []
        return f"shard rule {self.number} (line {self.line}: {' '.join(words)})"


@dataclass
class RouterRule:
    """``[[router]]``: reference modules whose output 0 holds scores over experts, of which the
    model takes the top ``k`` per token (compared as decisions: layerdiff.compare.routing)."""

    site: Pattern
    k: int
    line: int | None = None


@dataclass
class Mapping:
    path: Path | None = None
    site_rules: list[SiteRule] = field(default_factory=list)
    pairs: dict[str, str] = field(default_factory=dict)           # reference site -> port site
    pair_args: dict[str, dict[str, str]] = field(default_factory=dict)  # [[pair]] args rules
    pair_calls: dict[str, CodeRef] = field(default_factory=dict)        # [[pair]] call adapters
    pair_outputs: dict[str, dict[str, str]] = field(default_factory=dict)  # [[pair]] outputs
    pair_output_transforms: dict[str, OutputConversion] = field(default_factory=dict)
    unmatched_reference: list[tuple[str, str]] = field(default_factory=list)  # (glob, why)
    unmatched_port: list[tuple[str, str]] = field(default_factory=list)
    unmatched_records: list[UnmatchedRecord] = field(default_factory=list)
    param_rules: list[ParamRule] = field(default_factory=list)
    shard_rules: list[ShardRule] = field(default_factory=list)
    # [mesh]: the ranks as a mesh, (name, size) outermost first, rank = row-major position
    mesh: list[tuple[str, int]] = field(default_factory=list)
    routers: list[RouterRule] = field(default_factory=list)      # [[router]]: scores -> top-k
    origin: str = ""  # where it came from, when not a file given by the user

    @classmethod
    def load(cls, path: str | Path) -> Mapping:
        return _load(ConfigFile.load(path, MappingError))

    @classmethod
    def from_text(cls, text: str, name: str, *, recorded_in: str = "the port trace") -> Mapping:
        """A mapping from its text as a trace records it (``recorded_in`` names the trace);
        ``name`` says TOML or YAML.

        A trace comes from whoever made it, so a mapping it records that names code
        (conversions, call adapters) is refused, and so are its ``reference_regex`` rules:
        Python's regular expressions backtrack, and a crafted one can take hours on one name.
        Globs are matched in linear time and stay. The user who trusts the file passes it with
        ``--map`` (:meth:`load`), which runs its code and regular expressions."""
        try:
            return _load(ConfigFile.parse(Path(name), text, MappingError),
                         recorded_in=recorded_in)
        except MappingError as exc:
            if recorded_in in str(exc):  # a refusal of what a trace may not run names it
                raise
            raise MappingError(f"{recorded_in} recorded a mapping at capture that cannot be "
                               f"read: {exc} (a mapping file given with --map FILE overrides "
                               "the recorded one)") from None

    @classmethod
    def recorded(cls, meta: dict, recorded_in: str) -> Mapping | None:
        """The mapping a trace's capture recorded (``capture --weights-from --map`` keeps the
        file's text in the meta), read as :meth:`from_text` reads it; None when there is
        none. ``recorded_in`` names the trace (or rank files) in what is said of it."""
        weights = meta.get("weights")
        recorded = weights.get("mapping") if isinstance(weights, dict) else None
        if not recorded:
            return None
        if not isinstance(recorded, dict) or not all(
                isinstance(recorded.get(key), str) for key in ("text", "name")):
            raise MappingError(f"{recorded_in} recorded a mapping at capture that cannot be "
                               "read: its meta weights.mapping needs 'name' and 'text' strings "
                               "(a mapping file given with --map FILE overrides it)")
        mapping = cls.from_text(recorded["text"], recorded["name"], recorded_in=recorded_in)
        mapping.origin = f"recorded in {recorded_in} at capture"
        return mapping

    @property
    def name(self) -> str:
        return str(self.path) if self.path else "no mapping"

    # ---- sites
    def rename(self, ref_module: str) -> tuple[str, dict[str, str], str] | None:
        """The port module a rule gives for a reference module, the rule's argument map and
        a label saying which rule."""
        for number, rule in enumerate(self.site_rules, start=1):
            groups = rule.reference.match(ref_module)
            if groups is not None:
                label = f"{self.path.name if self.path else 'mapping'} site rule {number}"
                return rule.reference.fill(rule.port, groups), rule.args, label
        return None

    def site_rule(self, ref_module: str) -> SiteRule | None:
        """The first [[site]] rule whose reference pattern matches ``ref_module``."""
        for rule in self.site_rules:
            if rule.reference.match(ref_module) is not None:
                return rule
        return None

    def _call_rule(self, ref_site: str) -> SiteRule | None:
        """The [[site]] rule whose module makes the call ``ref_site`` (module#call); None for
        an op site (module#call/op#k). A rule's adapter, outputs and conversion describe its
        module's own call, never the ops inside it (their arguments are not the module's), and
        a glob like ``layers.*`` would otherwise match those names too; ops pair by the op
        rules and [[pair]] entries (docs/ops.md)."""
        if _OP_SITE.search(ref_site):
            return None
        return self.site_rule(ref_site.rpartition("#")[0] or ref_site)

    def call_adapter(self, ref_site: str) -> CodeRef | None:
        """The call adapter for a reference site (module#call): its [[pair]]'s, else the
        [[site]] rule's that renames its module, else None."""
        if ref_site in self.pairs:
            return self.pair_calls.get(ref_site)
        rule = self._call_rule(ref_site)
        return rule.call if rule is not None else None

    def output_names(self, ref_site: str) -> dict[str, str]:
        """Reference output -> port output renames for a reference site (``outputs =``)."""
        if ref_site in self.pairs:
            return self.pair_outputs.get(ref_site, {})
        rule = self._call_rule(ref_site)
        return rule.outputs if rule is not None else {}

    def output_conversion(self, ref_site: str) -> OutputConversion | None:
        """The output conversion (``output_transform =``) for a reference site: its
        [[pair]]'s, else the [[site]] rule's that renames its module, else None."""
        if ref_site in self.pairs:
            return self.pair_output_transforms.get(ref_site)
        rule = self._call_rule(ref_site)
        return rule.output_transform if rule is not None else None

    def code_refs(self) -> list[CodeRef]:
        """Every function the mapping names (conversions, call adapters, then output
        conversions), once each."""
        found: dict[str, CodeRef] = {}
        for rule in self.param_rules:
            for step in rule.transforms:
                if is_code(step):
                    found.setdefault(step, CodeRef(step, self._where(rule.line)))
        for ref in [r.call for r in self.site_rules] + list(self.pair_calls.values()):
            if ref is not None:
                found.setdefault(ref.spec, ref)
        for conversion in [r.output_transform for r in self.site_rules] + list(
                self.pair_output_transforms.values()):
            if conversion is not None:
                found.setdefault(conversion.spec, conversion.code)
        return list(found.values())

    def _where(self, line: int | None) -> str:
        return f"{self.name} line {line}" if line is not None else self.name

    def unused_site_rules(self, ref_modules: Iterable[str]) -> list[str]:
        """A warning for each [[site]] rule whose reference pattern names none of
        ``ref_modules``: a typo would otherwise leave its sites unpaired, silently."""
        modules = list(ref_modules)
        name = self.path.name if self.path else "mapping"
        found = []
        for number, rule in enumerate(self.site_rules, start=1):
            matched = [module for module in modules if rule.reference.match(module) is not None]
            if not matched:
                found.append(f"{name} site rule {number} (line {rule.line}) matched no "
                             f"reference module (reference {rule.reference.text!r}): check its "
                             "pattern")
            elif all(self.why_unmatched("reference", module) is not None for module in matched):
                # an [[unmatched]] glob wins over the rule: its sites go unpaired, silently
                found.append(f"{name} site rule {number} (line {rule.line}) pairs nothing: "
                             f"every reference module it matches ({matched[0]}"
                             f"{', ...' if len(matched) > 1 else ''}) is also declared "
                             "[[unmatched]], which wins; narrow the [[unmatched]] glob or drop "
                             "the rule")
        return found

    def why_unmatched(self, side: str, site: str) -> str | None:
        """The file's reason when it declares ``site`` (module#call) to have no partner."""
        module = site.rpartition("#")[0] or site
        entries = self.unmatched_reference if side == "reference" else self.unmatched_port
        for glob, why in entries:
            if fnmatch.fnmatchcase(site, glob) or fnmatch.fnmatchcase(module, glob):
                return why
        return None

    def why_unmatched_record(self, side: str, site: str, role: str, arg: str) -> str | None:
        """The file's reason when it declares this one input or output (or its gradient) of
        ``site`` to have no partner (``[[unmatched]]`` with ``input =`` / ``output =``)."""
        for entry in self.unmatched_records:
            if entry.side == side and entry.covers(site, role, arg):
                return entry.why
        return None

    # ---- parameters
    def param_source(self, port_param: str,
                     module_partner: dict[str, str]) -> ParamSource | None:
        """Where ``port_param`` comes from: a [[param]] rule, else its module's partner
        (``module_partner``: port module -> reference module), else None."""
        for rule in self.param_rules:
            for part, pattern in enumerate(rule.port):
                groups = pattern.match(port_param)
                if groups is None:
                    continue
                try:
                    names = [pattern.fill(t, groups) for t in rule.reference]
                except ValueError as exc:
                    raise MappingError(f"{self.name} line {rule.line}: {exc}") from None
                return ParamSource(names, rule.transforms, rule.axis, part, len(rule.port),
                                   where=self._where(rule.line))
        module, _, leaf = port_param.rpartition(".")
        if module in module_partner:
            ref_module = module_partner[module]
            return ParamSource([f"{ref_module}.{leaf}" if ref_module else leaf])
        return None


    def module_partners(self, port_modules: Iterable[str], ref_modules: Iterable[str]
                        ) -> dict[str, str]:
        """Port module -> reference module, by explicit pairs, exact names and rename rules:
        the one resolution of a parameter's module that loading weights, map-check and the
        diff share. It needs no call of either module (a reference module whose weights its
        parent's code uses, ``F.conv1d(x, self.conv1d.weight)``, is never a site)."""
        port_modules = set(port_modules)
        partner: dict[str, str] = {}
        for ref_site, port_site in self.pairs.items():
            partner[port_site.rpartition("#")[0]] = ref_site.rpartition("#")[0]
        for module in sorted(set(ref_modules)):
            renamed = self.rename(module)
            target = module if module in port_modules else (renamed[0] if renamed else None)
            if target in port_modules:
                partner.setdefault(target, module)
        return partner

    # ---- shards (multi-rank ports)
    def shard_rule(self, module: str, role: str, arg: str) -> ShardRule | None:
        """The first [[shard]] rule that cuts this tensor of port module ``module`` across
        ranks (``role`` and ``arg`` as in the trace index), or None: replicated."""
        for rule in self.shard_rules:
            if rule.covers(module, role, arg):
                return rule
        return None

    def shard_rules_by_mesh_dim(self, module: str, role: str, arg: str
                                ) -> dict[str, ShardRule]:
        """With a ``[mesh]``: the first rule over each mesh dim that covers this tensor (a
        tensor may be cut along several); without: the first rule, under ``""``."""
        found: dict[str, ShardRule] = {}
        for rule in self.shard_rules:
            if rule.over not in found and rule.covers(module, role, arg):
                found[rule.over] = rule
                if not self.mesh:
                    break
        return found


def _load(config: ConfigFile, recorded_in: str | None = None) -> Mapping:
    config.check_keys(config.data, {"version", "site", "pair", "unmatched", "param", "shard",
                                   "router", "mesh"},
                      "the top level")
    version = config.data.get("version", 1)
    if version != 1:
        config.fail(f"mapping version {version!r} is not supported (this layerdiff reads 1)",
                    config.line_of("version"))
    mapping = Mapping(path=config.path)
    for number, (entry, line) in enumerate(config.tables("site"), start=1):
        mapping.site_rules.append(_site_rule(config, entry, number, line, recorded_in))
    for number, (entry, line) in enumerate(config.tables("pair"), start=1):
        _add_pair(mapping, config, entry, number, line)
    for number, (entry, line) in enumerate(config.tables("unmatched"), start=1):
        _add_unmatched(mapping, config, entry, number, line)
    for number, (entry, line) in enumerate(config.tables("param"), start=1):
        mapping.param_rules.append(_param_rule(config, entry, f"param rule {number}", line))
    mapping.mesh = _mesh(config)
    names = [name for name, _ in mapping.mesh]
    for number, (entry, line) in enumerate(config.tables("shard"), start=1):
        rule = _shard_rule(config, entry, number, line)
        if mapping.mesh and rule.over not in names:
            config.fail(f"shard rule {number}: with a [mesh] every rule names the mesh dim "
                        f"whose ranks hold its parts (over = one of {', '.join(names)}); got "
                        f"{rule.over or 'none'}", line)
        if not mapping.mesh and rule.over:
            config.fail(f"shard rule {number}: over = {rule.over!r} names a mesh dim, but the "
                        "mapping has no [mesh] table (e.g. [mesh] dp = 2, tp = 2)", line)
        mapping.shard_rules.append(rule)
    for number, (entry, line) in enumerate(config.tables("router"), start=1):
        mapping.routers.append(_router_rule(config, entry, number, line))
    code = mapping.code_refs()
    if recorded_in is not None and code:
        # the same stance as pickle: reading a file someone sent must never run code it names
        raise MappingError(f"{code[0].where}: {code[0].spec!r} is code, and this mapping was "
                           f"read from {recorded_in}, where code it names is not run (a trace "
                           f"comes from whoever made it); pass the mapping file with --map "
                           f"{config.path.name} to trust it")
    return mapping


def _site_rule(config: ConfigFile, entry: dict, number: int, line: int | None,
               recorded_in: str | None) -> SiteRule:
    where = f"site rule {number}"
    config.check_keys(entry, {"reference", "reference_regex", "port", "args", "call",
                              "outputs", "output_transform"}, where, line)
    if ("reference" in entry) == ("reference_regex" in entry):
        config.fail(f"{where} needs exactly one of 'reference' or 'reference_regex'", line)
    port = _string(config, entry, "port", where, line)
    if "reference_regex" in entry:
        text = _string(config, entry, "reference_regex", where, line)
        if recorded_in is not None:
            config.fail(f"{where} is a reference_regex, and this mapping was read from "
                        f"{recorded_in}, where a regular expression is not run (a crafted "
                        f"one can take hours to match a name); pass the mapping file with "
                        f"--map {config.path.name} to trust it", line)
        try:
            pattern = Pattern(text, regex=True)
        except re.error as exc:
            config.fail(f"{where}: reference_regex {text!r} is not a valid regular "
                        f"expression ({exc})", line)
        wanted = max((int(n) for n in re.findall(r"\\(\d+)", port)), default=0)
        if wanted > pattern.groups:
            config.fail(f"{where}: port '{port}' uses \\{wanted} but reference_regex has "
                        f"{pattern.groups} group(s)", line)
    else:
        pattern = Pattern(_string(config, entry, "reference", where, line))
        stars, holes = pattern.text.count("*"), port.count("*")
        if holes and holes != stars:
            config.fail(f"{where}: port '{port}' has {holes} '*' but reference "
                        f"'{pattern.text}' has {stars}", line)
    return SiteRule(pattern, port, _args(config, entry, where, line), line,
                    _call(config, entry, where, line), _outputs(config, entry, where, line),
                    _output_transform(config, entry, where, line))


def _add_pair(mapping: Mapping, config: ConfigFile, entry: dict, number: int,
              line: int | None) -> None:
    where = f"pair {number}"
    config.check_keys(entry, {"reference", "port", "args", "call", "outputs",
                              "output_transform"}, where, line)
    ref, port = (_string(config, entry, k, where, line) for k in ("reference", "port"))
    for name in (ref, port):
        if not re.fullmatch(r".+#\d+", name):
            config.fail(f"{where}: '{name}' is not a site; write module#call, e.g. "
                        "'decoder.pos#1', or an op site, e.g. 'blocks.0.attn#0/softmax#0'",
                        line)
    mapping.pairs[ref] = port
    mapping.pair_args[ref] = _args(config, entry, where, line)
    call = _call(config, entry, where, line)
    if call is not None:
        mapping.pair_calls[ref] = call
    mapping.pair_outputs[ref] = _outputs(config, entry, where, line)
    conversion = _output_transform(config, entry, where, line)
    if conversion is not None:
        mapping.pair_output_transforms[ref] = conversion


def _add_unmatched(mapping: Mapping, config: ConfigFile, entry: dict, number: int,
                   line: int | None) -> None:
    where = f"unmatched entry {number}"
    config.check_keys(entry, {"reference", "port", "why", "input", "output"}, where, line)
    if ("reference" in entry) == ("port" in entry):
        config.fail(f"{where} needs exactly one of 'reference' or 'port'", line)
    why = entry.get("why", "declared without partner in the mapping")
    side = "reference" if "reference" in entry else "port"
    if "input" in entry and "output" in entry:
        config.fail(f"{where} takes one of 'input' or 'output' (one record each entry)",
                    line)
    for role in ("input", "output"):
        if role in entry:
            arg = entry[role]
            if isinstance(arg, int) and not isinstance(arg, bool):
                arg = str(arg)
            if not isinstance(arg, str) or not arg:
                config.fail(f"{where} needs '{role}' as an argument path, e.g. "
                            f"{role} = \"1\" or {role} = \"attention_mask\"", line)
            mapping.unmatched_records.append(UnmatchedRecord(
                side, _string(config, entry, side, where, line), role, arg, str(why)))
    if "input" in entry or "output" in entry:
        return
    target = mapping.unmatched_reference if side == "reference" else mapping.unmatched_port
    target.append((_string(config, entry, side, where, line), str(why)))


SHARD_LAYOUTS = ("split", "zigzag", "partial", "replicate", "experts")


def _shard_rule(config: ConfigFile, entry: dict, number: int, line: int | None) -> ShardRule:
    where = f"shard rule {number}"
    config.check_keys(entry, {"site", "tensor", "dim", "layout", "experts", "over"}, where, line)
    site, tensor = (_string(config, entry, key, where, line) for key in ("site", "tensor"))
    if "#" in site:
        config.fail(f"{where}: site '{site}' names a call; shard rules take module paths "
                    "(a glob such as 'blocks.*.mlp.fc'), the same for every call", line)
    layout = entry.get("layout", "split")
    if layout not in SHARD_LAYOUTS:
        config.fail(f"{where}: layout {layout!r} is not one of {', '.join(SHARD_LAYOUTS)} "
                    "(docs/distributed.md says what each means)", line)
    dim = entry.get("dim")
    if layout in ("partial", "replicate"):
        if dim is not None:
            config.fail(f"{where}: a {layout} tensor is not cut along a dim; remove 'dim'", line)
    elif not isinstance(dim, int) or isinstance(dim, bool):
        config.fail(f"{where} needs 'dim' as an integer (the dimension the ranks' parts are "
                    f"joined along; -1 for the last), got {dim!r}", line)
    experts = entry.get("experts")
    if (layout == "experts") != (experts is not None):
        config.fail(f"{where}: " + ("layout = \"experts\" needs 'experts', the expert indices "
                                    "each rank holds in order ([[0, 2], [1, 3]])"
                                    if layout == "experts" else
                                    "'experts' goes with layout = \"experts\""), line)
    held: tuple[tuple[int, ...], ...] = ()
    if experts is not None:
        if not (isinstance(experts, list) and experts and all(
                isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in ids) for ids in experts)):
            config.fail(f"{where}: 'experts' lists, for each rank in order, the expert indices "
                        f"it holds ([[0, 2], [1, 3]]); got {experts!r}", line)
        held = tuple(tuple(ids) for ids in experts)
        counted = sorted(i for ids in held for i in ids)
        if counted != list(range(len(counted))):
            config.fail(f"{where}: 'experts' must hold each of experts 0..{len(counted) - 1} on "
                        f"exactly one rank; it holds {counted}", line)
    over = entry.get("over", "")
    if not isinstance(over, str):
        config.fail(f"{where}: 'over' names a [mesh] dim as a string, got {over!r}", line)
    return ShardRule(Pattern(site), tensor, dim, line, number, layout, held, over)


def _mesh(config: ConfigFile) -> list[tuple[str, int]]:
    """``[mesh]``: name = size per mesh dim, outermost first (rank = row-major position)."""
    table = config.data.get("mesh")
    if table is None:
        return []
    line = config.line_of("mesh")
    if not isinstance(table, dict) or not table or not all(
            isinstance(size, int) and not isinstance(size, bool) and size > 0
            for size in table.values()):
        config.fail("[mesh] gives each mesh dim's size, outermost first (dp = 2 then tp = 2: "
                    f"rank = dp_index * 2 + tp_index); got {table!r}", line)
    return [(str(name), int(size)) for name, size in table.items()]


def _router_rule(config: ConfigFile, entry: dict, number: int, line: int | None) -> RouterRule:
    where = f"router rule {number}"
    config.check_keys(entry, {"site", "k"}, where, line)
    site = _string(config, entry, "site", where, line)
    if "#" in site:
        config.fail(f"{where}: site '{site}' names a call; router rules take the reference's "
                    "module paths (a glob such as 'model.layers.*.mlp.gate')", line)
    k = entry.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        config.fail(f"{where} needs 'k' as a positive integer (how many experts each token "
                    f"takes from the router's scores), got {k!r}", line)
    return RouterRule(Pattern(site), k, line)


def _param_rule(config: ConfigFile, entry: dict, where: str, line: int | None) -> ParamRule:
    config.check_keys(entry, {"port", "reference", "transform", "axis"}, where, line)
    transforms = _transforms(config, entry.get("transform", "copy"), where, line)
    ports, refs = _names(config, entry, "port", where, line), _names(config, entry, "reference",
                                                                      where, line)
    structural = [t for t in transforms if t in ("concat", "split")]
    many = {"concat": "reference", "split": "port"}.get(structural[0] if structural else "")
    named = structural[0] if structural else ", ".join(transforms)
    for side, names in (("port", ports), ("reference", refs)):
        if side == many and len(names) < 2:
            config.fail(f"{where}: '{named}' needs a list of two or more {side} names", line)
        if side != many and len(names) != 1:
            config.fail(f"{where}: '{named}' takes one {side} name, got {len(names)}", line)
    axis = entry.get("axis", 0)
    if not isinstance(axis, int) or isinstance(axis, bool):
        config.fail(f"{where}: axis must be an integer, got {axis!r}", line)
    patterns = [Pattern(name) for name in ports]
    for pattern in patterns:
        for template in refs:
            if template.count("*") not in (0, pattern.text.count("*")):
                config.fail(f"{where}: reference '{template}' has {template.count('*')} '*' "
                            f"but port '{pattern.text}' has {pattern.text.count('*')}", line)
    return ParamRule(patterns, refs, transforms, axis, line)


def _transforms(config: ConfigFile, value: object, where: str,
                line: int | None) -> tuple[str, ...]:
    """A transform name, or a list of them applied in order, checked."""
    chain = [value] if isinstance(value, str) else value
    if not isinstance(chain, list) or not all(isinstance(t, str) for t in chain):
        config.fail(f"{where}: transform must be a name or a list of names, e.g. "
                    f"[\"concat\", \"transpose\"], got {value!r}", line)
    if not chain:
        config.fail(f"{where}: transform is an empty list; give a transform, or leave it out "
                    "for a copy", line)
    for name in chain:
        if name not in TRANSFORMS and not is_code(name):
            config.fail(f"{where}: transform '{name}' is not one of {', '.join(TRANSFORMS)}, "
                        "nor a conversion function written 'package.module:function'", line)
    structural = [t for t in chain if t in ("concat", "split")]
    if len(structural) > 1:
        config.fail(f"{where}: transform {chain} has {len(structural)} concat/split steps; a "
                    "chain takes at most one (it sets how many names each side has)", line)
    return tuple(chain)


def _call(config: ConfigFile, entry: dict, where: str, line: int | None) -> CodeRef | None:
    """A rule's call adapter, ``call = "package.module:function"`` (checked for its form only:
    reading a mapping imports nothing)."""
    if "call" not in entry:
        return None
    if "args" in entry:  # two ways of making one call: the adapter's is the whole call
        config.fail(f"{where}: a rule with call makes the port's call alone (the adapter "
                    "receives every reference argument and returns the port's args and "
                    "kwargs), so args would not apply; rename or leave out arguments in the "
                    "adapter and remove args", line)
    spec = entry["call"]
    if not isinstance(spec, str) or not is_code(spec):
        config.fail(f"{where}: call must name a function as 'package.module:function', "
                    f"got {spec!r}", line)
    return CodeRef(spec, f"{config.path} line {line}" if line is not None else str(config.path))


def _outputs(config: ConfigFile, entry: dict, where: str, line: int | None) -> dict[str, str]:
    """A rule's ``outputs`` table: reference output path -> port output path."""
    outputs = entry.get("outputs", {})
    if not isinstance(outputs, dict) or not all(
            isinstance(v, (str, int)) and not isinstance(v, bool) and str(v)
            for v in outputs.values()):
        config.fail(f"{where}: outputs must be a table of reference output = port output "
                    "strings, e.g. outputs = { logits = \"0\" }", line)
    return {str(key): str(value) for key, value in outputs.items()}


def _output_transform(config: ConfigFile, entry: dict, where: str,
                      line: int | None) -> OutputConversion | None:
    """A rule's output conversion: ``output_transform = "package.module:function"``, or a
    table ``{ function = "...", takes = ["0", "1"], gives = "0" }`` (the port's outputs the
    function takes, in order, and the reference output it gives; both "0" by default).
    Checked for its form only: reading a mapping imports nothing."""
    if "output_transform" not in entry:
        return None
    value = entry["output_transform"]
    usage = ("output_transform must name a function as 'package.module:function', or be a "
             "table { function = \"package.module:function\", takes = [\"0\", \"1\"], "
             "gives = \"0\" }")
    table = value if isinstance(value, dict) else {"function": value}
    config.check_keys(table, {"function", "takes", "gives", "reference_inputs"},
                      f"{where}'s output_transform", line)
    spec = table.get("function")
    if not isinstance(spec, str) or not is_code(spec):
        config.fail(f"{where}: {usage}, got {value!r}", line)

    def path(item: object) -> str | None:
        if isinstance(item, int) and not isinstance(item, bool):
            return str(item)
        return item if isinstance(item, str) and item else None

    takes = table.get("takes", ["0"])
    takes = [takes] if isinstance(takes, (str, int)) and not isinstance(takes, bool) else takes
    paths = [path(item) for item in takes] if isinstance(takes, list) else [None]
    gives = path(table.get("gives", "0"))
    if not paths or None in paths or len(set(paths)) != len(paths) or gives is None:
        config.fail(f"{where}: output_transform's takes must be a list of the port's output "
                    "paths (each once, e.g. takes = [\"0\", \"1\"]) and gives one reference "
                    f"output path, got {value!r}", line)
    extra = table.get("reference_inputs", [])
    extra = [extra] if isinstance(extra, (str, int)) and not isinstance(extra, bool) else extra
    inputs = [path(item) for item in extra] if isinstance(extra, list) else [None]
    if None in inputs or len(set(inputs)) != len(inputs):
        config.fail(f"{where}: output_transform's reference_inputs must be a list of the "
                    "reference site's input paths (each once, e.g. reference_inputs = [\"2\"]), "
                    f"got {value!r}", line)
    return OutputConversion(
        CodeRef(spec, f"{config.path} line {line}" if line is not None else str(config.path)),
        tuple(paths), gives, tuple(inputs))


def _string(config: ConfigFile, entry: dict, key: str, where: str, line: int | None) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        config.fail(f"{where} needs '{key}' as a non-empty string", line)
    return value


def _names(config: ConfigFile, entry: dict, key: str, where: str,
           line: int | None) -> list[str]:
    value = entry.get(key)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        config.fail(f"{where} needs '{key}' as a name or a list of names", line)
    return names


def _args(config, entry: dict, where: str, line: int) -> dict[str, str]:
    """A rule's ``args`` table: reference argument -> port argument ("" when the port takes no
    such argument: it is not compared, and replay drops it)."""
    args = entry.get("args", {})
    if not isinstance(args, dict) or not all(isinstance(v, (str, int)) for v in args.values()):
        config.fail(f"{where}: args must be a table of reference argument = port argument "
                    "strings, e.g. args = { \"1\" = \"2\" }, or \"\" for an argument the "
                    "port does not take, e.g. args = { past_key_values = \"\" }", line)
    # YAML reads unquoted argument numbers as integers; arguments are names (strings).
    return {str(key): str(value) for key, value in args.items()}
