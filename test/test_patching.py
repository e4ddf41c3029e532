"""patching.Patch: installed once for nested and concurrent users, active only in their threads."""
import threading
import types

from torch_xla_jaxbridge._core import patching


def make():
  box = types.SimpleNamespace(f=lambda: "plain")
  original = box.f
  patch = patching.Patch(lambda: [box], {"f": lambda: "patched" if patch.active() else "plain"})
  return box, original, patch


def test_nested_entries_restore_once():
  box, original, patch = make()
  with patch:
    with patch:
      assert box.f() == "patched"
    assert box.f() == "patched"
  assert box.f is original


def test_other_threads_see_the_original_behaviour():
  box, _, patch = make()
  seen = []
  with patch:
    worker = threading.Thread(target=lambda: seen.append(box.f()))
    worker.start()
    worker.join()
    assert box.f() == "patched"
  assert seen == ["plain"]


def test_concurrent_users_keep_it_installed_until_the_last_leaves():
  box, original, patch = make()
  inside, release = threading.Event(), threading.Event()

  def user():
    with patch:
      inside.set()
      release.wait()

  worker = threading.Thread(target=user)
  worker.start()
  inside.wait()
  with patch:
    pass
  assert box.f is not original  # the worker is still inside
  release.set()
  worker.join()
  assert box.f is original


def test_an_unset_attribute_is_removed_again():
  owner = types.SimpleNamespace()
  patch = patching.Patch(lambda: [owner], {"hook": print})
  with patch:
    assert owner.hook is print and patch.original("hook") is None
  assert not hasattr(owner, "hook")
