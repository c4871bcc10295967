"""What the platform needs before anything starts, made or fetched once into .cache/.

fetch.py resolves the JVM jars from Maven Central (the projects in maven/); apt.py installs missing
Debian packages; local_fs.py and class_archive.py build the processor's file system jar and its
class-data-sharing archive.
"""
