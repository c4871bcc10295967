/*
 * Hadoop's local file system (file:) without a process per permission change.
 *
 * Without Hadoop's native library (pyspark ships none), RawLocalFileSystem sets the permissions of
 * every file and directory it creates by running `chmod` in a new process: a fork of the processor's
 * JVM (~1 GB) for each checkpoint file, ~17 per micro-batch (offset log, commit log, state
 * changelog, their checksum files). This one sets them through java.nio instead, the same mode bits
 * chmod would set; with the native library present it lets Hadoop do what it does. Everything else is
 * Hadoop's LocalFileSystem (checksummed) as is.
 *
 * Spark's driver uses it for file: paths with spark.hadoop.fs.file.impl; infra/local_fs.py compiles it
 * at set-up, services/processor/app.py (local_fs_options) puts it on the driver's class path.
 */
package io.streamforge.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsAction;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;

public class ForklessLocalFileSystem extends LocalFileSystem {
  public ForklessLocalFileSystem() {
    super(new Raw());
  }

  /** The raw (unchecksummed) local file system whose permission changes stay in this process. */
  public static class Raw extends RawLocalFileSystem {
    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      if (NativeIO.isAvailable()) {
        super.setPermission(p, permission);
        return;
      }
      Files.setPosixFilePermissions(pathToFile(p).toPath(), posix(permission));
    }
  }

  /** The owner, group and other bits of a Hadoop permission (what `chmod` gets from it). */
  static Set<PosixFilePermission> posix(FsPermission permission) {
    Set<PosixFilePermission> out = EnumSet.noneOf(PosixFilePermission.class);
    add(out, permission.getUserAction(),
        PosixFilePermission.OWNER_READ, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_EXECUTE);
    add(out, permission.getGroupAction(),
        PosixFilePermission.GROUP_READ, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_EXECUTE);
    add(out, permission.getOtherAction(),
        PosixFilePermission.OTHERS_READ, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_EXECUTE);
    return out;
  }

  private static void add(
      Set<PosixFilePermission> out, FsAction action,
      PosixFilePermission read, PosixFilePermission write, PosixFilePermission execute) {
    if (action.implies(FsAction.READ)) out.add(read);
    if (action.implies(FsAction.WRITE)) out.add(write);
    if (action.implies(FsAction.EXECUTE)) out.add(execute);
  }
}
