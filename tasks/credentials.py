"""Credentials inside a URI: find them (to refuse the URI) and mask them (in anything printed about one).

A URI in the config travels far: Prefect stores it as the flow run's parameters, run.json and the manifests
record it, MLflow gets the config as params, the log prints it. So a URI that carries a secret is refused where
it enters (tasks/config.py: TrackArgs, ServeArgs, DataArgs' source and eval_source; and the MLflow URI a run resolves
from its environment), and the secret goes where the library reads it from the environment instead
(MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN; a data source's: DATA_INSTEAD).

One definition serves the pydantic validator and the JSON schema that Prefect's server enforces on a
deployment's parameters (form_rule: so a URI with credentials typed into the UI form is refused before Prefect stores
it): plain regular expressions that Python's `re` and JavaScript read alike (no flags; letters matched
case-blind by listing both cases).
"""

from __future__ import annotations

import re

# A query parameter whose name holds one of these is taken for a secret (token=, api_key=, X-Amz-Signature=,
# password=, sig=, auth=...).
SECRET_WORDS = ("token", "secret", "password", "passwd", "pwd", "key", "auth", "sig", "credential")


def _either_case(word: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in word)


# scheme://user[:password]@host: anything before an '@' in the authority (a user name alone may be a token)
USERINFO = r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@"
# ?...&name=value where name holds a secret word
# (names bounded in length: an unbounded one made masking a long config value quadratic in its length)
SECRET_QUERY = r"[?&;][^=&;#]{0,200}(?:" + "|".join(map(_either_case, SECRET_WORDS)) + r")[^=&;#]{0,200}="
# what a URI with credentials matches (JSON schema `pattern`: searched, like re.search)
WITH_CREDENTIALS = rf"{USERINFO}|{SECRET_QUERY}"


def form_rule(field: str, instead: str) -> dict[str, object]:
    """The JSON schema that refuses a URI with credentials in the run form (Prefect's server checks it before it
    stores a run), worded for the form: a `not`, whose refusal quotes its description (a pattern's quotes the
    regular expression). Not a string (an empty optional field): nothing to refuse."""
    return {"not": {"description": f"{field} must hold no credentials (a user:password@ part, a token= query): put "
                                   f"them {instead}", "type": "string", "pattern": WITH_CREDENTIALS}}


def found(uri: str) -> list[str]:
    """The kinds of credentials `uri` carries, in words; [] when none."""
    kinds = []
    if re.search(USERINFO, uri):
        kinds.append("a user:password@ part before the host")
    if names := [m.group(0)[1:-1] for m in re.finditer(SECRET_QUERY, uri)]:
        kinds.append(f"the query parameter{'s' if len(names) > 1 else ''} {', '.join(names)}")
    return kinds


def mask(text: str) -> str:
    """`text` with the credentials of every URI in it replaced by ***: user:password@ and secret query values."""
    # a scheme is short (RFC 3986 sets no bound; 32 covers every registered one): unbounded, a long run of letters
    # was searched from each of its positions to its end
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^/?#\s'\"@]*@", r"\1***@", text)
    return re.sub(rf"({SECRET_QUERY})[^&;#\s'\"]*", r"\1***", text)


MLFLOW_INSTEAD = ("in the environment of the process that runs the flow, where MLflow reads them: "
                  "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN (a database store: "
                  "its driver's own, such as PGPASSWORD or ~/.pgpass)")
# where a data source's secret goes instead (docs/data.md, "Sources that need a secret"): the environment of the
# process that runs the flow (the worker's), where each filesystem library reads its own
DATA_INSTEAD = ("in the environment of the process that runs the flow (the worker's), where the library that reads "
                "the source finds them: for http(s):// a header in FSSPEC_HTTP, e.g. FSSPEC_HTTP='{\"client_kwargs\": "
                "{\"headers\": {\"Authorization\": \"Bearer ...\"}}}'; for s3:// AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE); for gs:// GOOGLE_APPLICATION_CREDENTIALS; for a hub dataset "
                "HF_TOKEN (docs/data.md)")


FORM_MLFLOW = "in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) of the worker"
FORM_DATA = "in the worker's environment (FSSPEC_HTTP, AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN: docs/data.md)"


def refusal(field: str, uri: str, instead: str = MLFLOW_INSTEAD) -> str | None:
    """Why `uri` (from `field`) cannot be used, with the fix (`instead`: where its secret goes); None when it carries
    no credentials."""
    kinds = found(uri)
    if not kinds:
        return None
    return (f"{field}={mask(uri)} holds credentials ({' and '.join(kinds)}), which would be written into the run's "
            "records, MLflow's params and Prefect's flow-run parameters. Give the URI without them and put them "
            f"{instead}")
